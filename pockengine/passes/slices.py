"""Sink leading-row slices of gradients into the ops that produce them.

Partial-channel updates train only the first k output channels of a weight: the
training graph asks for ``slice(g, axis=0, 0:k)`` of the weight's gradient. This
pass rewrites such a slice of a matmul, weight-gradient convolution, transpose,
elementwise op, ``sum_to`` or ``embedding_grad`` (the lookups of ids below k, into k
rows) into the same op on sliced operands, recursively, so
the backward matmul/conv runs on the slice instead of computing the whole gradient
and then slicing it. Dead-code elimination then drops the full-size producers.

Needs: a verified graph. Guarantees: the same values for every graph output and
effect, and no dead node (the replaced producers are removed). Only slices with
step 1 that start at 0, of values read by that slice alone, are sunk (a value read
elsewhere is still computed in full, once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pockengine.ir import Fact, Graph, GraphBuilder, Node, Value, get_op
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["sink_slices"]


class _Sinker:
    def __init__(self, graph: Graph) -> None:
        self.b = GraphBuilder.rewriting(graph)
        self.users = {k: len(v) for k, v in graph.users().items()}
        for v in graph.outputs:
            self.users[v.name] = self.users.get(v.name, 0) + 1
        self.producer: dict[str, Node] = {}
        self.source = ""

    def emit(self, op: str, *inputs: Value, **attrs: Any) -> Value:
        out = self.b.call(op, *inputs, source=self.source, **attrs)
        self.producer[out.name] = self.b.nodes[-1]
        return out

    def append(self, node: Node) -> None:
        self.b.append(node)
        for out in node.outputs:
            self.producer[out.name] = node

    def rows(self, x: Value, axis: int, k: int) -> Value:
        """A value equal to ``x`` sliced to [0:k] along ``axis``."""
        if x.shape[axis] == k:
            return x
        node = self.producer.get(x.name)
        if node is not None and self.users.get(x.name, 0) == 1 and len(node.outputs) == 1:
            rule = _RULES.get(node.op)
            if rule is None and get_op(node.op).has(Fact.ELEMENTWISE):
                rule = _elementwise
            if rule is not None:
                out = rule(self, node, axis, k)
                if out is not None:
                    return out
        return self.emit("slice", x, axis=axis, start=0, stop=k, step=1)


def _elementwise(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    rank = node.output.type.rank
    ins = []
    for v in node.inputs:
        ax = axis - (rank - v.type.rank)
        ins.append(v if ax < 0 or v.shape[ax] == 1 else s.rows(v, ax, k))
    return s.emit(node.op, *ins, **node.attrs)


def _transpose(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    perm = node.attrs["perm"]
    assert isinstance(perm, tuple)
    return s.emit("transpose", s.rows(node.inputs[0], int(perm[axis]), k), perm=perm)


def _matmul(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    a, b = node.inputs
    rank = node.output.type.rank
    if axis == rank - 1:
        return s.emit("matmul", a, s.rows(b, b.type.rank - 1, k))
    if axis == rank - 2:
        return s.emit("matmul", s.rows(a, a.type.rank - 2, k), b)
    return None


def _conv_weight_grad(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    x, gy = node.inputs
    w_shape = node.attrs["w_shape"]
    groups = node.attrs["groups"]
    assert isinstance(w_shape, tuple) and isinstance(groups, int)
    if axis != 0:
        return None
    shape = (k, *w_shape[1:])
    if groups == 1:
        return s.emit(
            "conv2d_weight_grad", x, s.rows(gy, 1, k), **node.attrs.replace(w_shape=shape)
        )
    if groups == w_shape[0] and w_shape[1] == 1 and x.shape[1] == groups:  # depthwise
        attrs = node.attrs.replace(w_shape=shape, groups=k)
        return s.emit("conv2d_weight_grad", s.rows(x, 1, k), s.rows(gy, 1, k), **attrs)
    return None


def _sum_to(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    (y,) = node.inputs
    shape = node.attrs["shape"]
    assert isinstance(shape, tuple)
    lead = y.type.rank - len(shape)
    if y.shape[axis + lead] != shape[axis]:
        return None  # the sliced axis is one that sum_to reduces
    new_shape = tuple(k if i == axis else d for i, d in enumerate(shape))
    return s.emit("sum_to", s.rows(y, axis + lead, k), shape=new_shape)


def _embedding_grad(s: _Sinker, node: Node, axis: int, k: int) -> Value | None:
    """The first k rows of a table's gradient (a partially trained embedding, e.g. a tied
    head's leading rows): the lookups of ids below k, scattered into k rows. A lookup of
    another id has its gradient zeroed and its id set to 0, so the whole table's gradient
    ([num_rows, dim]: 113 MB for SmolLM2's 49,152 tokens) is never made."""
    if axis != 0:
        return None
    gz, ids = node.inputs
    num_rows, padding = node.attrs["num_rows"], node.attrs["padding_idx"]
    assert isinstance(num_rows, int) and (padding is None or isinstance(padding, int))
    row = padding % num_rows if padding is not None else None  # (checked when built)
    kind = ids.type.dtype.value
    keep = s.emit("lt", ids, s.emit("full", shape=(), value=k, dtype=kind))
    ids_in = s.emit("where", keep, ids, s.emit("full", shape=(), value=0, dtype=kind))
    mask = s.emit("reshape", s.emit("cast", keep, dtype=gz.type.dtype.value), shape=(*ids.shape, 1))
    return s.emit(
        "embedding_grad",
        s.emit("mul", gz, mask),
        ids_in,
        num_rows=k,
        padding_idx=row if row is not None and row < k else None,
    )


_RULES: dict[str, Callable[[_Sinker, Node, int, int], Value | None]] = {
    "transpose": _transpose,
    "matmul": _matmul,
    "conv2d_weight_grad": _conv_weight_grad,
    "sum_to": _sum_to,
    "embedding_grad": _embedding_grad,
}


def _is_leading_slice(node: Node) -> bool:
    return node.op == "slice" and node.attrs["start"] == 0 and node.attrs["step"] == 1


def sink_slices(graph: Graph) -> Graph:
    s = _Sinker(graph)
    renamed: dict[str, Value] = {}
    for node in graph.nodes:
        if any(v.name in renamed for v in node.inputs):
            node = node.replace(inputs=tuple(renamed.get(v.name, v) for v in node.inputs))
        s.source = node.source
        s.b.phase = node.phase
        if _is_leading_slice(node):
            axis, stop = node.attrs["axis"], node.attrs["stop"]
            assert isinstance(axis, int) and isinstance(stop, int)
            x = node.inputs[0]
            renamed[node.output.name] = s.rows(x, axis % x.type.rank, stop)
        else:
            s.append(node)
    # the full-size producers that the slices replaced are dead now
    return eliminate_dead_code(s.b.build([renamed.get(v.name, v) for v in graph.outputs]))
