"""A chain of elementwise ops computed in one pass: ``elementwise_chain``.

``elementwise_chain(x0, ..., x{n-1}, ops=(op0, ...), args=((a, b), ...))`` runs step k as
``ops[k]`` on its operands ``args[k]``: an operand j < n is input ``x_j`` (broadcast as the
op broadcasts it), j >= n the result of step ``j - n``. The last step's result is the
chain's. Every step is one of ``CHAIN_OPS`` with no attributes, so the chain computes the
same float operations in the same order as its steps one node each: the NumPy kernel runs
each step's own kernel. The C backend makes it after autodiff from elementwise nodes whose
results have one reader (``backends/c/fuse_ew.py``), so the intermediates are never
stored; it has no VJP. Its result may overwrite an input of its own shape that dies there
(``Fact.INPLACE``): each element's inputs are read before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Attrs, Fact, Sample, ShapeError, TensorType, defop, get_op
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, same_dtype

__all__ = ["CHAIN_OPS"]

# the ops a chain may hold (op -> its number of operands): float math without attributes
CHAIN_OPS: dict[str, int] = {
    **dict.fromkeys(("add", "sub", "mul", "div"), 2),
    **dict.fromkeys(("neg", "sigmoid", "rsqrt", "exp", "tanh", "reciprocal"), 1),
}


def _step_operands(
    ops: Sequence[str], args: Sequence[Sequence[int]], inputs: int
) -> list[tuple[int, ...]]:
    """Each step's operand indices, checked: a known op, its arity, earlier values only."""
    if len(ops) != len(args) or not ops:
        raise ShapeError(f"elementwise_chain: {len(ops)} ops for {len(args)} operand lists")
    steps = []
    for k, (op, operands) in enumerate(zip(ops, args, strict=True)):
        if CHAIN_OPS.get(op) != len(operands):
            raise ShapeError(f"elementwise_chain step {k}: {op}{tuple(operands)} is not a chain op")
        if any(not 0 <= int(j) < inputs + k for j in operands):
            raise ShapeError(f"elementwise_chain step {k}: operands {operands} out of range")
        steps.append(tuple(int(j) for j in operands))
    return steps


@defop("elementwise_chain", facts=Fact.ELEMENTWISE | Fact.INPLACE)
class ElementwiseChain:
    """Steps ``ops[k](operands args[k])`` over the inputs and earlier steps; the result is
    the last step's. Forward only (made after autodiff, no VJP)."""

    @staticmethod
    def infer(*xs: TensorType, ops: Sequence[str], args: Sequence[Sequence[int]]) -> TensorType:
        dtype = same_dtype("elementwise_chain", *xs)
        if not dtype.is_float:
            raise ShapeError(f"elementwise_chain needs float inputs, got {dtype}")
        shapes = [x.shape for x in xs]
        for operands in _step_operands(ops, args, len(xs)):
            shapes.append(broadcast_shapes(*(shapes[j] for j in operands)))
        return TensorType(shapes[-1], dtype)

    @staticmethod
    def kernel(*xs: Array, ops: Sequence[str], args: Sequence[Sequence[int]]) -> Array:
        values = list(xs)
        for op, operands in zip(ops, _step_operands(ops, args, len(xs)), strict=True):
            values.append(get_op(op).kernel(*(values[j] for j in operands)))
        return values[-1]

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Attrs) -> int:
        ops = attrs["ops"]
        assert isinstance(ops, tuple)
        return sum(get_op(str(op)).flops(outs, outs, Attrs()) for op in ops)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        """SwiGLU's forward, silu(g) * u as the frontend writes it, with a row vector."""
        g, u, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.random(4)
        attrs = {"ops": ("sigmoid", "mul", "mul", "mul"), "args": ((0,), (0, 3), (4, 1), (5, 2))}
        return [Sample((g, u, w), attrs)]
