"""Which batch inputs index a tensor, and the range their values must lie in.

A class target reaches the loss as the index of a ``gather`` over the log-probabilities
(cross-entropy lowers to ``log_softmax`` + ``gather`` in every frontend; a large vocabulary's
to the fused ``linear_log_softmax_gather``, whose index is its third input), and token ids as
the index of an ``embedding``. Backends wrap a negative index (``-1`` would train as the
last class, as Python's ``x[-1]`` does) or fail with a raw error past the end, so the
step checks such inputs at the batch boundary instead. ``index_bounds`` reads the graph
once: from each ``gather``/``embedding`` it walks the index back through views, casts
and the loss's ``where(index != ignore_index, index, 0)`` guard to a batch input,
collecting the ignored values, and takes the bound from the indexed axis's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import Fact, Graph, Node, Role, Value, get_op

__all__ = ["IndexBound", "index_bounds", "out_of_range"]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class IndexBound:
    """Batch input ``input`` must hold values in ``[0, high)`` or one of ``ignored``."""

    input: str
    high: int
    ignored: frozenset[int]
    what: str  # "class target", "token id"


def _full_value(node: Node | None) -> int | None:
    if node is None or node.op != "full" or node.outputs[0].shape != ():
        return None
    value = node.attrs.get("value")
    return int(value) if isinstance(value, int | float) and float(value).is_integer() else None


def _ignore_guard(node: Node, producer: dict[str, Node]) -> tuple[Value, int] | None:
    """``where(ne(a, full(v)), a, full(c))``: the guarded value ``a`` and ``v``."""
    cond, kept, other = node.inputs
    ne = producer.get(cond.name)
    if ne is None or ne.op != "ne" or _full_value(producer.get(other.name)) is None:
        return None
    for a, b in (ne.inputs, ne.inputs[::-1]):
        v = _full_value(producer.get(b.name))
        if a.name == kept.name and v is not None:
            return kept, v
    return None


def _keeps_values(node: Node) -> bool:
    """A view op (reshape, slice, transpose, broadcast, cast) passes an index's values
    through unchanged, except a cast from float, which truncates."""
    src, out = node.inputs[0].dtype, node.outputs[0].dtype
    return get_op(node.op).has(Fact.VIEW) and (src == out or not src.is_float)


def _batch_source(
    index: Value, producer: dict[str, Node], inputs: set[str]
) -> tuple[str, frozenset[int]] | None:
    """The batch input ``index`` is a view of, and the values a guard lets through."""
    ignored: set[int] = set()
    value = index
    while value.name not in inputs:
        node = producer.get(value.name)
        if node is None:
            return None
        if _keeps_values(node):
            value = node.inputs[0]
        elif node.op == "where" and (guard := _ignore_guard(node, producer)) is not None:
            value, v = guard
            ignored.add(v)
        else:
            return None
    return value.name, frozenset(ignored)


def index_bounds(graph: Graph) -> tuple[IndexBound, ...]:
    """Every batch input that indexes a tensor (class targets, token ids), with its range."""
    producer = {out.name: n for n in graph.nodes for out in n.outputs}
    inputs = {v.name for v in graph.inputs if v.role is Role.INPUT}
    found: dict[tuple[str, int, frozenset[int], str], None] = {}
    for node in graph.nodes:
        if node.op == "gather":
            x, index = node.inputs[0], node.inputs[1]
            axis = node.attrs["axis"]
            assert isinstance(axis, int)
            high, what = x.shape[axis % len(x.shape)], "class target"
        elif node.op == "embedding":
            index, high, what = node.inputs[1], node.inputs[0].shape[0], "token id"
        elif node.op == "linear_log_softmax_gather":  # the fused loss: (x, w, target)
            w, what = node.inputs[1], "class target"
            index, high = node.inputs[2], w.shape[0 if node.attrs["vocab_major"] else 1]
        else:
            continue
        source = _batch_source(index, producer, inputs)
        if source is not None:
            found[(source[0], high, source[1], what)] = None
    return tuple(IndexBound(name, high, ignored, what) for name, high, ignored, what in found)


def out_of_range(array: Array, bound: IndexBound) -> str | None:
    """Why ``array`` breaks ``bound`` (the first bad position and value), or None."""
    if array.dtype.kind not in "iu":
        return None
    if array.size == 0 or (array.min() >= 0 and array.max() < bound.high):
        return None  # the common case: two reductions, no temporaries
    bad = (array < 0) | (array >= bound.high)
    for value in bound.ignored:
        bad &= array != value
    if not bad.any():
        return None
    position = tuple(int(i) for i in np.argwhere(bad)[0])
    at = position[0] if len(position) == 1 else position
    allowed = f" and is not the ignore_index {sorted(bound.ignored)}" if bound.ignored else ""
    return (
        f"{bound.what} {int(array[position])} at position {at} is outside [0, {bound.high})"
        f"{allowed}; {int(bad.sum())} value(s) out of range in all"
    )
