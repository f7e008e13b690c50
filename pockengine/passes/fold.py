"""Constant folding and the algebraic identities that autodiff leaves behind.

Needs: a verified graph, after autodiff (``stop_gradient`` is removed as an identity,
which is right only once nothing is differentiated any more). Guarantees, for each pure
node in order:

- *Folding.* A node whose inputs are all compile-time constants (results of
  ``full``, ``arange`` or of nodes folded before it; never graph inputs, whose
  values are not in the graph) is evaluated with its op's NumPy kernel. When every
  element of a result is the same (bit for bit), the node becomes a ``full`` with
  the same result value; the IR has no literal-tensor node, so a non-uniform result
  stays as it is (and still counts as a constant for the nodes after it).
  Uniform elementwise and view nodes are evaluated on one element, so a large
  constant costs nothing to fold; other nodes only when their inputs and results
  have at most ``EVAL_LIMIT`` elements.
- *Identities.* ``mul(x, 1)``, ``div(x, 1)``, ``add(x, 0)``, ``sub(x, 0)`` (with a
  uniform constant 1 or 0 and ``x`` of the result's type), ``reshape``,
  ``broadcast_to`` and ``sum_to`` to ``x``'s own shape, ``cast`` to ``x``'s own
  dtype, ``transpose`` by the identity permutation and ``stop_gradient`` (the identity
  once autodiff has run) are removed: later reads (and graph outputs) read ``x``. A
  transpose of a transpose and a reshape of a reshape become one node on the inner
  input (which dead-code elimination may then drop).

A read is never redirected to a param, buffer or state at or after the node that
writes it, so verify's effect invariant still holds. Folded nodes keep their result
names; removed nodes leave unused producers behind for ``eliminate_dead_code``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import Attrs, DType, Fact, Graph, Node, TensorType, Value, get_op
from pockengine.ir.arrays import Array
from pockengine.ir.rewrite import substitute
from pockengine.plan.liveness import last_reads

__all__ = ["EVAL_LIMIT", "fold_constants"]


EVAL_LIMIT = 1 << 16  # elements of a non-uniform constant evaluated at compile time

# A view that only moves data (reshape, transpose, broadcast_to, slice): a uniform input
# gives a uniform result.
_DATA_VIEW = Fact.SHAPE | Fact.VIEW


@dataclass(frozen=True, slots=True)
class _Const:
    """A value known at compile time; a uniform one is a zero-stride broadcast."""

    array: Array
    uniform: bool

    def first(self) -> Array:
        """The first element as a 1-element array (the value of a uniform constant)."""
        return np.ascontiguousarray(self.array.reshape(-1)[:1])


def _uniform(element: Array, t: TensorType) -> _Const:
    return _Const(np.broadcast_to(element.reshape(()), t.shape), True)


def _is_uniform(array: Array) -> bool:
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.size == 0:
        return True
    rows = flat.view(np.uint8).reshape(flat.size, -1)
    return bool((rows == rows[0]).all())


def _numpy_types(node: Node) -> list[np.dtype[Any]] | None:
    if any(v.dtype is DType.BF16 for v in (*node.inputs, *node.outputs)):
        return None  # no NumPy dtype: left to the backend
    return [v.dtype.to_numpy() for v in node.outputs]


def _evaluate(node: Node, ins: list[_Const]) -> list[_Const] | None:
    """The node's results from constant inputs, or None when it is not evaluated."""
    dtypes = _numpy_types(node)
    if dtypes is None:
        return None
    if node.op == "full":  # known from its attributes, at any size
        element = np.full(1, node.attrs["value"], dtype=dtypes[0])
        return [_uniform(element, node.outputs[0].type)]
    opdef = get_op(node.op)
    outs = [v.type for v in node.outputs]
    sizes = [t.numel for t in outs] + [int(c.array.size) for c in ins]
    all_uniform = all(c.uniform for c in ins) and min(sizes) > 0 and len(outs) == 1
    with np.errstate(all="ignore"):
        if all_uniform and opdef.has(_DATA_VIEW):
            return [_uniform(ins[0].first(), outs[0])]
        if all_uniform and opdef.has(Fact.ELEMENTWISE):
            (one,) = opdef.run([c.first() for c in ins], node.attrs)
            return [_uniform(np.asarray(one, dtype=dtypes[0]).reshape(-1)[:1], outs[0])]
        if max(sizes, default=0) > EVAL_LIMIT:
            return None
        try:
            results = opdef.run([np.array(c.array) for c in ins], node.attrs)
        except (ArithmeticError, IndexError, TypeError, ValueError):
            return None  # the same error will name the node when it runs
    consts = []
    for array, t, dtype in zip(results, outs, dtypes, strict=True):
        value = np.asarray(array, dtype=dtype)
        if value.shape != t.shape:
            return None  # a kernel that disagrees with its shape rule: leave it to run
        consts.append(_Const(value, _is_uniform(value)))
    return consts


def _as_full(node: Node, consts: list[_Const]) -> list[Node]:
    """``full`` nodes for a node whose results are all uniform, else the node itself."""
    if not all(c.uniform for c in consts):
        return [node]
    fulls = []
    for v, c in zip(node.outputs, consts, strict=True):
        element = c.first() if c.array.size else np.zeros(1, v.dtype.to_numpy())
        attrs = Attrs(shape=v.shape, value=element.item(), dtype=str(v.dtype))
        fulls.append(Node("full", (), (v,), attrs, node.source, node.phase))
    return fulls


def _is_const(known: dict[str, _Const], v: Value, target: float) -> bool:
    c = known.get(v.name)
    return c is not None and c.uniform and c.array.size > 0 and bool(c.first()[0] == target)


_NEUTRAL = {"mul": 1.0, "add": 0.0}  # either operand may be the neutral constant
_RIGHT_NEUTRAL = {"div": 1.0, "sub": 0.0}  # only the right operand


def _same_value(node: Node, known: dict[str, _Const], defs: dict[str, Node]) -> Value | Node | None:
    """An input equal to the node's result, a simpler node for it, or None."""
    out = node.outputs[0] if len(node.outputs) == 1 else None
    if out is None or not node.inputs:
        return None
    x = node.inputs[0]
    if node.op in _NEUTRAL:
        neutral = _NEUTRAL[node.op]
        for a, c in (node.inputs, node.inputs[::-1]):
            if a.type == out.type and _is_const(known, c, neutral):
                return a
    right = _RIGHT_NEUTRAL.get(node.op)
    if right is not None and x.type == out.type and _is_const(known, node.inputs[1], right):
        return x
    # x -> x when the result has x's type (Fact.SAME_TYPE_IDENTITY; stop_gradient always
    # does: after autodiff it is a copy)
    if get_op(node.op).has(Fact.SAME_TYPE_IDENTITY) and x.type == out.type:
        return x
    if node.op == "transpose" and node.attrs["perm"] == tuple(range(x.type.rank)):
        return x
    return _merged_view(node, defs.get(x.name))


def _merged_view(node: Node, inner: Node | None) -> Value | Node | None:
    """A transpose of a transpose, or a reshape of a reshape, as one node (or none)."""
    if inner is None or inner.op != node.op:
        return None
    if node.op == "reshape":
        return node.replace(inputs=inner.inputs)
    if node.op != "transpose":
        return None
    p, q = inner.attrs["perm"], node.attrs["perm"]
    if not (isinstance(p, tuple) and isinstance(q, tuple)):
        return None
    perm = tuple(p[i] for i in q)
    if perm == tuple(range(len(perm))):
        return inner.inputs[0]
    return node.replace(inputs=inner.inputs, attrs=node.attrs.replace(perm=perm))


@dataclass
class _Folder:
    """The state of one fold over a graph (the pass itself stays a pure function)."""

    last_read: dict[str, int]  # in the input graph; graph outputs are read at the end
    written_at: dict[str, int]  # the index of the effect that writes each value
    known: dict[str, _Const]
    mapping: dict[str, Value]  # redirected reads
    defs: dict[str, Node]  # the emitted node that defines each result

    def readable(self, v: Value, until: int) -> bool:
        """Whether reads of ``v`` up to node index ``until`` see its original value."""
        return until < self.written_at.get(v.name, until + 1)

    def step(self, i: int, node: Node) -> list[Node]:
        (node,) = substitute((node,), self.mapping)
        if get_op(node.op).effectful:
            return [node]
        constant = get_op(node.op).has(Fact.CONSTANT)
        if constant or (node.inputs and all(v.name in self.known for v in node.inputs)):
            consts = _evaluate(node, [self.known[v.name] for v in node.inputs])
            if consts is not None:
                self.known.update((v.name, c) for v, c in zip(node.outputs, consts, strict=True))
                return [node] if constant else _as_full(node, consts)
        return self.simplify(i, node)

    def simplify(self, i: int, node: Node) -> list[Node]:
        """Drop the node if it is an identity, or replace it by a simpler one."""
        for _ in range(4):  # a merged view may itself be an identity
            simpler = _same_value(node, self.known, self.defs)
            if isinstance(simpler, Value):
                if self.readable(simpler, self.last_read.get(node.output.name, i)):
                    self.mapping[node.output.name] = simpler
                    return []
                break
            if simpler is None or not all(self.readable(v, i) for v in simpler.inputs):
                break
            node = simpler
        return [node]


def _write_positions(graph: Graph) -> dict[str, int]:
    return {
        node.inputs[j].name: i
        for i, node in enumerate(graph.nodes)
        for j in get_op(node.op).mutates
    }


def fold_constants(graph: Graph) -> Graph:
    """Evaluate constant nodes at compile time and drop algebraic identities."""
    folder = _Folder(last_reads(graph), _write_positions(graph), {}, {}, {})
    nodes: list[Node] = []
    for i, node in enumerate(graph.nodes):
        for new in folder.step(i, node):
            nodes.append(new)
            folder.defs.update((v.name, new) for v in new.outputs)
    if tuple(nodes) == graph.nodes:
        return graph
    outputs = tuple(folder.mapping.get(v.name, v) for v in graph.outputs)
    return graph.replace(nodes=tuple(nodes), outputs=outputs)
