"""In-place reuse: which elementwise results may overwrite the buffer of an input that dies.

A node whose op has ``Fact.INPLACE`` may write its result into the memory of one of its
inputs ``v`` when nothing can read that memory afterwards. ``reusable_inputs`` decides it
from the graph alone, so the memory plan (``plan_memory``) and a backend that acts on it
(the torch backend writes such results with ``out=``) agree. ``v`` qualifies when:

- the result has ``v``'s shape and dtype (no broadcast grows it, no promotion changes it);
- node ``i`` is the last reader of ``v`` and of every value that may share ``v``'s memory:
  values that ops with ``Fact.VIEW`` derive from the same buffer (a backend may implement
  them as views; ``cast`` to the same dtype, ``sum_to`` over no axis and ``stop_gradient``
  may return their input itself), and earlier results written into that buffer;
- the buffer is the step's own: not a graph input (a batch the caller still holds, a
  param, buffer or optimizer state), nor a compile-time constant (``Fact.CONSTANT``),
  nor reached through ``broadcast_to`` (several elements of the view share one address);
- no other input of node ``i`` shares the buffer in a different view (``add(x, x)`` is
  fine, ``add(x, transpose(x))`` would read elements already overwritten).

A result written in place joins its input's buffer: a later node may overwrite it in turn,
so a chain ``bn -> relu6 -> +residual`` runs in one buffer.
"""

from __future__ import annotations

from pockengine.ir import Fact, Graph, Node, all_ops, get_op
from pockengine.plan.liveness import liveness

__all__ = ["inplace_ops", "reusable_inputs"]

_FOREIGN = ""  # the root of memory the step does not own


def inplace_ops() -> frozenset[str]:
    """The registered ops with ``Fact.INPLACE`` (their results may overwrite an input)."""
    return frozenset(name for name, d in all_ops().items() if d.has(Fact.INPLACE))


def reusable_inputs(graph: Graph, ops: frozenset[str] | None = None) -> dict[int, int]:
    """Node index -> the position of the input whose buffer its result may take; only
    nodes of ``ops`` qualify (default: the ops with ``Fact.INPLACE``)."""
    allowed = inplace_ops() if ops is None else ops
    last = {name: iv.end for name, iv in liveness(graph).intervals.items()}
    root = {v.name: _FOREIGN for v in graph.inputs}  # value -> the buffer it may live in
    writable: dict[str, bool] = {}
    group_end: dict[str, int] = {}  # buffer -> the last read of any value in it
    reuse: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        outs = node.outputs
        opdef = get_op(node.op)
        if opdef.has(Fact.CONSTANT):
            root.update((v.name, _FOREIGN) for v in outs)
            continue
        if opdef.has(Fact.VIEW) and outs:
            src = node.inputs[0].name
            r = root.get(src, _FOREIGN)
            root[outs[0].name] = r
            writable[outs[0].name] = writable.get(src, False) and node.op != "broadcast_to"
            group_end[r] = max(group_end.get(r, -1), last[outs[0].name])
            continue
        eligible = node.op in allowed and len(outs) == 1
        k = _reusable(i, node, root, writable, group_end) if eligible else None
        if k is not None:
            reuse[i] = k
            r = root[node.inputs[k].name]
            root[outs[0].name] = r
            group_end[r] = max(group_end[r], last[outs[0].name])
        else:
            for v in outs:
                root[v.name] = v.name
                group_end[v.name] = last[v.name]
        for v in outs:
            writable[v.name] = True
    return reuse


def _reusable(
    i: int,
    node: Node,
    root: dict[str, str],
    writable: dict[str, bool],
    group_end: dict[str, int],
) -> int | None:
    """The first input of node ``i`` whose buffer its result may take, if any."""
    out = node.outputs[0]
    for k, v in enumerate(node.inputs):
        r = root.get(v.name, _FOREIGN)
        if r == _FOREIGN or not writable.get(v.name, False):
            continue
        if v.shape != out.shape or v.dtype != out.dtype or group_end.get(r) != i:
            continue
        if any(root.get(u.name) == r and u.name != v.name for u in node.inputs):
            continue
        return k
    return None
