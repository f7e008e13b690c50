"""C-backend rewrite: batch norm fused with the hardtanh (relu6) after it, both ways.

Backward first: ``batch_norm_grad(hardtanh_grad(gz, z), x, w, mean, var)``, with ``z =
hardtanh(y)`` (or ``y`` itself) and ``y`` the first result of a ``batch_norm(x, w, b)``
of the same ``eps`` whose statistics are ``mean`` and ``var``, becomes
``batch_norm_hardtanh_grad(gz, x, w, b, mean, var)`` (``ops/norm_act.py``): the kernel
recomputes ``y`` from ``x`` and the statistics to mask the gradient, so the masked
gradient is never stored, and a ``batch_norm`` and ``hardtanh`` that rematerialisation
put in the backward only for this mask are read by nothing and go. Then the forward:
``hardtanh(y)`` with ``y`` read by nothing else becomes one ``batch_norm_hardtanh(x, w,
b)`` at the batch norm's place, whose output pass clips, so ``y`` is never stored. Last,
a batch norm (fused or not) that repeats an earlier one on the same ``x``, ``w`` and ``b``
(rematerialisation's copy in the backward pass) becomes ``batch_norm_apply(x, w, b,
mean, var)`` of the earlier one's statistics, and what read the repeat's statistics
reads the earlier one's (the same numbers): one read of ``x`` instead of three.

The memory plan runs on the rewritten graph, so it holds neither ``y`` nor the masked
gradient of a fused pair.

Needs: a verified training graph. Guarantees: the fused nodes keep the replaced nodes'
result names and types (the clipped ``z``, the statistics, ``gx``, ``gw``, ``gb``); a
fused node reads nothing a parameter update wrote before it; a result something else
still reads is kept.
"""

from __future__ import annotations

from pockengine.ir import Attrs, CompileError, Graph, Node, Value, get_op
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["fuse_batch_norm_hardtanh"]


def _bounds(node: Node) -> tuple[float, float]:
    """A hardtanh's (or its gradient's) bounds."""
    low, high = node.attrs.get("min_val"), node.attrs.get("max_val")
    assert isinstance(low, int | float) and isinstance(high, int | float), node
    return float(low), float(high)


def _made_by_bn(y: Value, producers: dict[str, Node], x: Value, eps: object) -> Node | None:
    """The ``batch_norm`` of ``x`` (with ``eps``) whose first result is ``y``."""
    node = producers.get(y.name)
    if node is None or node.op != "batch_norm" or node.outputs[0] != y:
        return None
    return node if node.inputs[0] == x and node.attrs.get("eps") == eps else None


def _grad(node: Node, producers: dict[str, Node], users: dict[str, list[Node]]) -> Node | None:
    """``node`` (a batch_norm_grad) as one batch_norm_hardtanh_grad, or None."""
    gy, x, w, mean, var = node.inputs
    eps = node.attrs.get("eps")
    mask = producers.get(gy.name)
    if mask is None or mask.op != "hardtanh_grad" or len(users.get(gy.name, [])) != 1:
        return None
    gz, masked = mask.inputs
    clip = producers.get(masked.name)
    if clip is not None and clip.op == "hardtanh" and _bounds(clip) == _bounds(mask):
        masked = clip.inputs[0]
    bn = _made_by_bn(masked, producers, x, eps)
    stats = producers.get(mean.name)
    if bn is None or stats is None or stats.op != "batch_norm":
        return None
    if stats.inputs != bn.inputs or stats.outputs[1:] != (mean, var) or bn.inputs[1] != w:
        return None
    low, high = _bounds(mask)
    attrs = Attrs(eps=eps, min_val=low, max_val=high)
    return node.replace(
        op="batch_norm_hardtanh_grad", inputs=(gz, x, w, bn.inputs[2], mean, var), attrs=attrs
    )


def _checked(fused: Node, outputs: tuple[Value, ...]) -> Node:
    types = get_op(fused.op).infer_types([v.type for v in fused.inputs], fused.attrs)
    if types != tuple(v.type for v in outputs):
        raise CompileError(f"fuse_bn: {fused.op} would change {outputs}")
    return fused


def _fuse_backward(graph: Graph) -> Graph:
    producers, users = graph.producers(), graph.users()
    returned = {v.name for v in graph.outputs}
    written: set[str] = set()  # values a parameter update wrote so far
    nodes, changed = [], False
    for node in graph.nodes:
        fused = None
        if node.op == "batch_norm_grad" and node.inputs[0].name not in returned:
            fused = _grad(node, producers, users)
        if fused is not None and not any(v.name in written for v in fused.inputs):
            node, changed = _checked(fused, node.outputs), True
        opdef = get_op(node.op)
        written.update(node.inputs[k].name for k in opdef.mutates)
        nodes.append(node)
    return eliminate_dead_code(graph.replace(nodes=tuple(nodes))) if changed else graph


def _fuse_forward(graph: Graph) -> Graph:
    producers, users = graph.producers(), graph.users()
    returned = {v.name for v in graph.outputs}
    clips: dict[str, Node] = {}  # batch_norm's y -> the hardtanh that alone reads it
    for node in graph.nodes:
        if node.op != "hardtanh":
            continue
        y = node.inputs[0]
        bn = producers.get(y.name)
        alone = len(users.get(y.name, [])) == 1 and y.name not in returned
        if bn is not None and bn.op == "batch_norm" and bn.outputs[0] == y and alone:
            clips[y.name] = node
    if not clips:
        return graph
    nodes = []
    for node in graph.nodes:
        if node.op == "hardtanh" and clips.get(node.inputs[0].name) is node:
            continue
        clip = clips.get(node.outputs[0].name) if node.op == "batch_norm" else None
        if clip is not None:
            low, high = _bounds(clip)
            attrs = Attrs(node.attrs, min_val=low, max_val=high)
            outputs = (clip.outputs[0], *node.outputs[1:])
            fused = node.replace(op="batch_norm_hardtanh", outputs=outputs, attrs=attrs)
            node = _checked(fused, outputs)
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes))


def _reuse_statistics(graph: Graph) -> Graph:
    """Each repeat of a batch norm (same x, w, b and eps, none of them written since the
    first) as a ``batch_norm_apply`` of the first one's statistics. The repeat's
    statistics are the first's, so what reads them (a recomputation registers every
    result of the node it repeats) reads the first's instead; a repeat whose statistics
    the graph returns stays."""
    returned = {v.name for v in graph.outputs}
    first: dict[tuple[str, ...], Node] = {}
    written: set[str] = set()
    same: dict[str, Value] = {}  # a repeat's statistics -> the first's
    nodes, changed = [], False
    for node in graph.nodes:
        if any(v.name in same for v in node.inputs):
            node = node.replace(inputs=tuple(same.get(v.name, v) for v in node.inputs))
        if node.op in ("batch_norm", "batch_norm_hardtanh"):
            key = (*(v.name for v in node.inputs), repr(node.attrs.get("eps")))
            made = first.setdefault(key, node)
            stats = [v.name for v in node.outputs[1:]]
            fresh = not any(v.name in written for v in node.inputs)
            if made is not node and fresh and returned.isdisjoint(stats):
                same.update(zip(stats, made.outputs[1:], strict=True))
                clip = _bounds(node) if node.op == "batch_norm_hardtanh" else (None, None)
                attrs = Attrs(eps=node.attrs["eps"], min_val=clip[0], max_val=clip[1])
                inputs = (*node.inputs, *made.outputs[1:])
                fused = node.replace(
                    op="batch_norm_apply", inputs=inputs, outputs=node.outputs[:1], attrs=attrs
                )
                node, changed = _checked(fused, node.outputs[:1]), True
        written.update(node.inputs[k].name for k in get_op(node.op).mutates)
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes)) if changed else graph


def fuse_batch_norm_hardtanh(graph: Graph) -> Graph:
    """``graph`` with its batch_norm -> hardtanh chains fused, backward and forward, and
    repeated batch norms reading the saved statistics (the module docstring); ``graph``
    itself when it has none."""
    return _reuse_statistics(_fuse_forward(_fuse_backward(graph)))
