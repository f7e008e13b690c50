"""Which batch inputs index a tensor, and the range their values must lie in.

A class target reaches the loss as the index of a ``gather`` over the log-probabilities
(cross-entropy lowers to ``log_softmax`` + ``gather`` in every frontend; a large vocabulary's
to the fused ``linear_log_softmax_gather``, whose index is its third input), and token ids as
the index of an ``embedding``. Backends wrap a negative index (``-1`` would train as the
last class, as Python's ``x[-1]`` does) or fail with a raw error past the end, so the
step checks such inputs at the batch boundary instead. An advanced index (``x[ids]``:
the ``index`` op; ``x.index_put_(..., accumulate=True)``: ``index_put_add``) counts a
negative value from the end, as NumPy, ATen and the C kernels do, so its range on an
axis of size n is ``[-n, n)``. ``index_bounds`` reads the graph once: from each indexing
node it walks the index back through views, casts and the loss's
``where(index != ignore_index, index, 0)`` guard to a batch input, collecting the ignored
values, and takes the bound from the indexed axis's size.

An index computed from constants alone (learned positions ``wpe(arange(t))``: nodes
without inputs, such as ``full`` and ``arange``, and the ``const`` inputs and frozen
params whose values the compile is given) is no batch input: it is evaluated with the
NumPy kernels and checked once, at compile time (``CompileError`` naming the node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pockengine.ir import CompileError, Fact, Graph, Node, Role, Value, get_op
from pockengine.ir.arrays import Array

__all__ = ["IndexBound", "index_bounds", "out_of_range"]


@dataclass(frozen=True)
class IndexBound:
    """Batch input ``input`` must hold values in ``[low, high)`` or one of ``ignored``."""

    input: str
    high: int
    ignored: frozenset[int]
    what: str  # "class target", "token id", "index"
    low: int = 0  # -high for an advanced index, which counts negative values from the end


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
    if not node.inputs:
        return False  # full, arange: a constant, not a view of anything
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


_EVAL_LIMIT = 1 << 20  # elements of a constant index (and of what it is made from) evaluated


def _known_inputs(graph: Graph, values: Mapping[str, Array]) -> dict[str, Array]:
    """Graph inputs whose values stay as given: constants and frozen params."""
    return {
        v.name: values[v.name]
        for v in graph.inputs
        if v.name in values and (v.role is Role.CONST or (v.role is Role.PARAM and not v.trainable))
    }


def _static_values(graph: Graph, known: Mapping[str, Array]) -> set[str]:
    """Names of the values computed from ``known`` inputs and input-less nodes alone."""
    static = set(known)
    for node in graph.nodes:
        if not get_op(node.op).effectful and all(v.name in static for v in node.inputs):
            static.update(v.name for v in node.outputs)
    return static


class _Constants:
    """The arrays of static values, evaluated on demand with the NumPy kernels, in graph
    order (no recursion: an index may sit at the end of a long chain)."""

    def __init__(self, graph: Graph, values: Mapping[str, Array]) -> None:
        self.graph = graph
        self.known: dict[str, Array] = _known_inputs(graph, values)
        self.static = _static_values(graph, self.known)
        self.producer = {out.name: n for n in graph.nodes for out in n.outputs}

    def value(self, index: Value) -> Array | None:
        """``index``'s array when it is static and small enough to evaluate, else None."""
        if index.name not in self.static:
            return None
        needed: set[str] = set()  # first result names of the nodes to run
        stack = [index.name]
        while stack:
            node = self.producer.get(stack.pop())
            if node is None or node.outputs[0].name in needed:
                continue
            if any(v.type.numel > _EVAL_LIMIT for v in node.outputs):
                return None
            needed.add(node.outputs[0].name)
            stack.extend(v.name for v in node.inputs if v.name not in self.known)
        for node in self.graph.nodes:
            first = node.outputs[0].name if node.outputs else None  # effects have no results
            if first in needed and first not in self.known and not self._run(node):
                return None
        return self.known.get(index.name)

    def _run(self, node: Node) -> bool:
        try:
            with np.errstate(all="ignore"):
                ins = [np.asarray(self.known[v.name]) for v in node.inputs]
                results = get_op(node.op).run(ins, node.attrs)
        except (ArithmeticError, IndexError, KeyError, TypeError, ValueError):
            return False  # left for the backend to run (and report)
        for out, array in zip(node.outputs, results, strict=True):
            self.known[out.name] = np.asarray(array)
        return True


def _check_constant_index(node: Node, index: Array, low: int, high: int) -> None:
    """An indexing node's constant index: every value in ``[low, high)``."""
    if index.dtype.kind not in "iu" or index.size == 0:
        return
    bad = (index < low) | (index >= high)
    if bad.any():
        position = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CompileError(
            f"{node.op} at {node.source or '<unknown>'}: its index is a constant holding "
            f"{int(index[position])} at position {position}, outside [{low}, {high})"
        )


_Indexed = tuple[Value, int, int, str]  # an index, its range [low, high), what it is


def _advanced(node: Node, target: tuple[int, ...], indices: list[Value]) -> list[_Indexed]:
    """``index``-style indices on ``axes`` of ``target``: each in ``[-n, n)``."""
    axes = node.attrs["axes"]
    assert isinstance(axes, tuple)
    sizes = [target[int(a) % len(target)] for a in axes]
    return [(v, -n, n, "index") for v, n in zip(indices, sizes, strict=True)]


def _indices(node: Node) -> list[_Indexed]:
    """The index inputs of ``node`` with the range each must lie in (none for other ops)."""
    if node.op == "gather":
        x, index = node.inputs[0], node.inputs[1]
        axis = node.attrs["axis"]
        assert isinstance(axis, int)
        return [(index, 0, x.shape[axis % len(x.shape)], "class target")]
    if node.op == "embedding":
        return [(node.inputs[1], 0, node.inputs[0].shape[0], "token id")]
    if node.op == "linear_log_softmax_gather":  # the fused loss: (x, w, target)
        w = node.inputs[1]
        return [(node.inputs[2], 0, w.shape[0 if node.attrs["vocab_major"] else 1], "class target")]
    if node.op == "index":  # (x, *indices)
        return _advanced(node, node.inputs[0].shape, list(node.inputs[1:]))
    if node.op == "index_put_add":  # (x, values, *indices)
        return _advanced(node, node.inputs[0].shape, list(node.inputs[2:]))
    if node.op == "index_grad":  # (gz, *indices), scattered into attrs["shape"]
        shape = node.attrs["shape"]
        assert isinstance(shape, tuple)
        return _advanced(node, tuple(int(d) for d in shape), list(node.inputs[1:]))
    return []


def index_bounds(graph: Graph, values: Mapping[str, Array] | None = None) -> tuple[IndexBound, ...]:
    """Every batch input that indexes a tensor (class targets, token ids, advanced indices),
    with its range.

    An index computed from constants (``values``: the graph inputs' values, where known)
    is checked here instead, and a ``CompileError`` names the node indexing out of range.
    """
    producer = {out.name: n for n in graph.nodes for out in n.outputs}
    inputs = {v.name for v in graph.inputs if v.role is Role.INPUT}
    constants = _Constants(graph, values or {})
    found: dict[IndexBound, None] = {}
    for node in graph.nodes:
        for index, low, high, what in _indices(node):
            source = _batch_source(index, producer, inputs)
            if source is not None:
                found[IndexBound(source[0], high, source[1], what, low)] = None
            elif (constant := constants.value(index)) is not None:
                _check_constant_index(node, constant, low, high)
    return tuple(found)


def out_of_range(array: Array, bound: IndexBound) -> str | None:
    """Why ``array`` breaks ``bound`` (the first bad position and value), or None."""
    if array.dtype.kind not in "iu":
        return None
    low, high = bound.low, bound.high
    if array.size == 0 or (array.min() >= low and array.max() < high):
        return None  # the common case: two reductions, no temporaries
    bad = (array < low) | (array >= high)
    for value in bound.ignored:
        bad &= array != value
    if not bad.any():
        return None
    position = tuple(int(i) for i in np.argwhere(bad)[0])
    at = position[0] if len(position) == 1 else position
    allowed = f" and is not the ignore_index {sorted(bound.ignored)}" if bound.ignored else ""
    return (
        f"{bound.what} {int(array[position])} at position {at} is outside [{low}, {high})"
        f"{allowed}; {int(bad.sum())} value(s) out of range in all"
    )
