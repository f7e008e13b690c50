"""Fusion of a large-vocabulary loss head: ``gather(log_softmax(x @ w (+ b)), target)``
becomes ``linear_log_softmax_gather`` (``ops.fused_loss``), chunked over rows, so that the
``[tokens, vocab]`` logits and their gradient never exist whole.

The pattern is what every frontend emits for cross-entropy over a final linear layer:
``matmul(x, w)`` (``w`` a ``[k, vocab]`` matrix; when it is the transpose of a
``[vocab, k]`` one, an ``nn.Linear`` weight or a tied embedding, the fused op takes that
one with ``vocab_major`` and writes its gradient in that layout), an optional ``add`` of a
``[vocab]`` bias, then views of the rows -- the
reshape of ``[batch, seq, vocab]`` to ``[tokens, vocab]``, the causal-LM shift
``slice(logits, 1, 0:seq-1)``, transpositions (the ONNX frontend's classes-on-axis-1 and
back) -- then ``log_softmax`` over the vocabulary and ``gather`` at the ``[tokens, 1]``
targets. The same views are applied to ``x`` (rows of ``k`` instead of ``vocab``
elements), and the gather's result is replaced by the fused op's reshaped to
``[tokens, 1]``: the ignore-index guard, the negation and the mean that follow are kept
as they are. It runs on the forward graph, before autodiff, which then differentiates
the fused op (its VJP emits the chunked ``linear_log_softmax_gather_grad``).

Only a vocabulary of at least ``min_vocab`` entries is fused (a classifier's few classes
gain nothing from chunking and would pay the backward's recomputed matmul), and only when
every value between the product and the gather has that one reader: logits that are also
returned or read elsewhere must exist anyway.

Needs: a verified forward graph. Guarantees: the same loss and gradients up to float
rounding (the log-sum-exp is taken per chunk; the values are the same); the replaced
nodes are dead afterwards and removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pockengine.ir import Attrs, Graph, GraphBuilder, Node, Phase, Value, get_op
from pockengine.passes.fuse import NodeIndex, rewrite

__all__ = [
    "CHUNK_ELEMENTS",
    "FUSED_LOSS_OPS",
    "MIN_VOCAB",
    "fuse_linear_cross_entropy",
    "fuse_loss_backward",
]

MIN_VOCAB = 8192  # smallest vocabulary fused (language models have 30k-250k entries)
CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MiB of float32
FORWARD_OP, GRAD_OP = "linear_log_softmax_gather", "linear_log_softmax_gather_grad"
WITH_GRAD_OP = "linear_log_softmax_gather_with_grad"
FUSED_LOSS_OPS = frozenset({FORWARD_OP, GRAD_OP, WITH_GRAD_OP})
_ROW_VIEWS = frozenset({"reshape", "slice", "transpose"})


@dataclass(frozen=True)
class _Match:
    x: Value  # the left operand of the product
    w: Value  # [k, vocab]
    bias: Value | None  # [vocab]
    views: tuple[Node, ...]  # from the product to the [tokens, vocab] logits, in order


def _last_axis(node: Node, value: Value) -> bool:
    axis = node.attrs["axis"]
    return isinstance(axis, int) and axis % value.type.rank == value.type.rank - 1


def _vocab_axis_before(view: Node, after: int) -> int | None:
    """Where the vocabulary axis is in ``view``'s input, given where it is in its output;
    None when ``view`` mixes it with the rows."""
    x, out = view.inputs[0], view.outputs[0]
    if view.op == "transpose":
        perm = view.attrs["perm"]
        assert isinstance(perm, tuple)
        axis = perm[after]
        return axis if isinstance(axis, int) else None
    if view.op == "slice":
        return None if view.attrs["axis"] % x.type.rank == after else after  # type: ignore[operator]
    last = out.type.rank - 1  # a reshape: the vocabulary stays whole only as the last axis
    ok = after == last and x.shape[-1] == out.shape[-1]
    return x.type.rank - 1 if ok else None


def _views_to_product(logits: Value, index: NodeIndex) -> tuple[Node, list[Node]] | None:
    """The node before the row views leading to ``logits`` (vocabulary last), and the views
    in forward order."""
    views: list[Node] = []
    value, axis = logits, logits.type.rank - 1
    while True:
        node = index.sole_producer(value)
        if node is None:
            return None
        if node.op not in _ROW_VIEWS:
            views.reverse()
            return (node, views) if axis == value.type.rank - 1 else None
        before = _vocab_axis_before(node, axis)
        if before is None:
            return None
        views.append(node)
        value, axis = node.inputs[0], before


def _product(node: Node, vocab: int, index: NodeIndex) -> tuple[Value, Value, Value | None] | None:
    """x, w and the bias of ``matmul(x, w)`` or ``add(matmul(x, w), b)``."""
    bias = None
    if node.op == "add":
        for i, operand in enumerate(node.inputs):
            other = node.inputs[1 - i]
            inner = index.sole_producer(operand)
            if inner is not None and inner.op == "matmul" and other.shape == (vocab,):
                node, bias = inner, other
                break
        else:
            return None
    if node.op != "matmul":
        return None
    x, w = node.inputs
    if w.type.rank != 2 or w.shape[1] != vocab or x.type.rank < 2 or x.dtype != w.dtype:
        return None
    if bias is not None and bias.dtype != w.dtype:
        return None
    return x, w, bias


def _match(gather: Node, index: NodeIndex, min_vocab: int) -> _Match | None:
    if gather.op != "gather":
        return None
    logp, target = gather.inputs
    if logp.type.rank != 2 or not _last_axis(gather, logp) or logp.shape[1] < min_vocab:
        return None
    if target.shape != (logp.shape[0], 1):
        return None
    softmax = index.sole_producer(logp)
    if softmax is None or softmax.op != "log_softmax" or not _last_axis(softmax, logp):
        return None
    found = _views_to_product(softmax.inputs[0], index)
    if found is None:
        return None
    head, views = found
    product = _product(head, logp.shape[1], index)
    if product is None:
        return None
    x, w, bias = product
    return _Match(x, w, bias, tuple(views))


def _replayed(b: GraphBuilder, x: Value, views: Sequence[Node], source: str, name: str) -> Value:
    """``x`` through the views, each taking rows of ``x``'s width instead of ``vocab``."""
    width = x.shape[-1]
    while views and views[-1].op == "reshape":  # the caller reshapes to [tokens, k] anyway
        views = views[:-1]
    for view in views:
        attrs: dict[str, Any] = dict(view.attrs)
        if view.op == "reshape":
            attrs["shape"] = (*view.outputs[0].shape[:-1], width)
        x = b.call(view.op, x, source=source, name=name, **attrs)
    return x


def _vocab_major(w: Value, producers: dict[str, Node]) -> tuple[Value, bool]:
    """``w`` [k, vocab], or the [vocab, k] matrix it transposes (an ``nn.Linear`` weight, a
    tied embedding): the kernels read that one as it is and write its gradient in its own
    layout, which the optimizer then reads contiguously."""
    node = producers.get(w.name)
    if node is not None and node.op == "transpose" and node.attrs["perm"] == (1, 0):
        return node.inputs[0], True
    return w, False


def _balanced_chunk(tokens: int, most: int) -> int:
    """Rows a chunk: as few chunks as ``most`` rows each allow, of equal size. A short last
    chunk costs a whole pass over the weight for a few rows (512 tokens at 170 rows a
    chunk: 170, 170, 170 and 2; balanced: 4 x 128)."""
    count = -(-tokens // most)
    return -(-tokens // count)


def _fused(
    b: GraphBuilder,
    gather: Node,
    m: _Match,
    renamed: dict[str, Value],
    index: NodeIndex,
    chunk_elements: int,
) -> Value:
    # new names derive from the gather's, so none meets a later node's original name
    src, name = gather.source, f"{gather.output.name}_fused"
    x, w = renamed.get(m.x.name, m.x), renamed.get(m.w.name, m.w)
    tokens, vocab = gather.inputs[0].shape
    rows = _replayed(b, x, m.views, src, name)
    rows = b.call("reshape", rows, shape=(tokens, x.shape[-1]), source=src, name=name)
    target = b.call("reshape", gather.inputs[1], shape=(tokens,), source=src, name=name)
    bias = [] if m.bias is None else [renamed.get(m.bias.name, m.bias)]
    chunk = _balanced_chunk(tokens, max(1, chunk_elements // vocab))
    w, major = _vocab_major(w, index.producers)
    picked, _ = b.call_multi(
        "linear_log_softmax_gather",
        rows,
        w,
        target,
        *bias,
        chunk=chunk,
        vocab_major=major,
        source=src,
        name=name,
    )
    return b.call("reshape", picked, shape=(tokens, 1), source=src, name=name)


def fuse_linear_cross_entropy(
    graph: Graph, *, min_vocab: int = MIN_VOCAB, chunk_elements: int = CHUNK_ELEMENTS
) -> Graph:
    """The graph with each large-vocabulary ``gather(log_softmax(linear))`` fused."""

    def rule(
        b: GraphBuilder, node: Node, index: NodeIndex, renamed: dict[str, Value]
    ) -> Value | None:
        m = _match(node, index, min_vocab)
        return None if m is None else _fused(b, node, m, renamed, index, chunk_elements)

    return rewrite(graph, rule)


def fuse_loss_backward(graph: Graph) -> Graph:
    """The training graph with each fused loss and its backward kernel merged into one
    ``linear_log_softmax_gather_with_grad`` where that is sound: each chunk's logits are
    then made once instead of twice (the backward's recomputation was one more
    ``[tokens, k] x [k, vocab]`` matmul a step: for SmolLM2 at 512 tokens, 29 GFLOP).

    Sound where the backward kernel's cotangents ``gp`` and ``scale`` do not depend on the
    forward op's outputs: a loss that is a mean or sum of the picked log-probabilities
    (masked or not) has a gradient known before the loss is. The nodes computing them
    (the seed, the mean's and the mask's backward) move to just before the merged node,
    which takes the forward op's place; a cotangent that reads the loss (a loss reweighted
    by its own log-probabilities) leaves the pair as it is, and so does any effect among
    those nodes. Needs: a verified training graph. Guarantees: the same values; every
    other node keeps its relative order."""
    while (merged := _merge_one(graph)) is not None:
        graph = merged
    return graph


def _merge_one(graph: Graph) -> Graph | None:
    nodes = graph.nodes
    at = {out.name: i for i, n in enumerate(nodes) for out in n.outputs}
    for gi, grad in enumerate(nodes):
        if grad.op != GRAD_OP:
            continue
        gp, scale, x, w, index, lse, *bias = grad.inputs
        fi = at.get(lse.name)
        if fi is None or nodes[fi].op != FORWARD_OP:
            continue
        forward = nodes[fi]
        same = tuple(v.name for v in forward.inputs) == tuple(v.name for v in (x, w, index, *bias))
        if not same or any(forward.attrs[k] != grad.attrs[k] for k in ("chunk", "vocab_major")):
            continue
        moved = _cotangent_nodes(nodes, at, fi, (gp, scale))
        if moved is None:
            continue
        attrs = Attrs({**grad.attrs})
        both = Node(
            WITH_GRAD_OP,
            (gp, scale, x, w, index, *bias),
            (*forward.outputs, *grad.outputs),
            attrs,
            forward.source,
            Phase.FORWARD,
        )
        get_op(WITH_GRAD_OP).infer_types([v.type for v in both.inputs], attrs)
        rest = [n for i, n in enumerate(nodes[fi + 1 :], fi + 1) if i not in moved and i != gi]
        order = [*nodes[:fi], *(nodes[i] for i in sorted(moved)), both, *rest]
        return graph.replace(nodes=tuple(order))
    return None


def _cotangent_nodes(
    nodes: Sequence[Node], at: dict[str, int], first: int, values: Sequence[Value]
) -> set[int] | None:
    """The positions after ``first`` of the nodes that ``values`` are computed from; None
    if one of them reads node ``first``'s outputs or has an effect."""
    made = {v.name for v in nodes[first].outputs}
    found: set[int] = set()
    todo = [at[v.name] for v in values if v.name in at and at[v.name] > first]
    while todo:
        i = todo.pop()
        if i in found:
            continue
        node = nodes[i]
        if any(v.name in made for v in node.inputs) or get_op(node.op).effectful:
            return None
        found.add(i)
        todo.extend(at[v.name] for v in node.inputs if v.name in at and at[v.name] > first)
    return found
