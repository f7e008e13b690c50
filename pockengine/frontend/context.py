"""What every frontend's converters share: emitting IR nodes tagged with the source of the
node being converted, and the decorator that fills a flat converter table."""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.ir import CompileError, DType, GraphBuilder, Value
from pockengine.ir.registry import registrar

__all__ = ["EmitContext", "const_ints", "norm_axis", "registrar"]


class EmitContext:
    """The builder and the current node's source (a module path, a layer name, a source
    line); every node a converter emits carries that source."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b
        self.source = ""

    def call(self, op: str, *inputs: Value, **attrs: Any) -> Value:
        return self.b.call(op, *inputs, source=self.source, **attrs)

    def call_multi(self, op: str, *inputs: Value, **attrs: Any) -> tuple[Value, ...]:
        return self.b.call_multi(op, *inputs, source=self.source, **attrs)

    def effect(self, op: str, *inputs: Value, **attrs: Any) -> None:
        self.b.effect(op, *inputs, source=self.source, **attrs)

    def full(self, value: float, dtype: DType, shape: tuple[int, ...] = ()) -> Value:
        return self.call("full", shape=tuple(shape), value=value, dtype=str(dtype))

    def cast(self, v: Value, dtype: DType) -> Value:
        return v if v.dtype is dtype else self.call("cast", v, dtype=str(dtype))


def const_ints(x: object, what: str) -> list[int]:
    """A compile-time int vector (axes, shapes, perms, pads) from a constant operand."""
    if not isinstance(x, np.ndarray):
        raise CompileError(f"{what} must be known at compile time (a constant), not computed")
    return [int(v) for v in np.asarray(x).reshape(-1)]


def norm_axis(axis: int, rank: int) -> int:
    """``axis`` in [0, rank) (a 0-d tensor has one axis here), or a CompileError."""
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise CompileError(f"axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)
