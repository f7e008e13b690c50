"""Elementwise ops: creation, unary, binary (NumPy broadcasting), ternary, casts.

Binary ops need equal dtypes (the frontends insert casts); a 0-d operand
broadcasts. VJP rules may return a cotangent in the broadcast shape: autodiff
sums it back to the input's shape, once, centrally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import ELEMENTWISE, DType, Sample, TensorType, Value, VJPContext, defop
from pockengine.ops._common import Array, broadcast_shapes, np_dtype, same_dtype

__all__: list[str] = []


@defop("full", groups=("creation",))
class Full:
    """A tensor filled with one value: full(shape, value, dtype). No inputs, no gradient."""

    @staticmethod
    def infer(*, shape: tuple[int, ...], value: float, dtype: str) -> TensorType:
        return TensorType(tuple(shape), DType(dtype))

    @staticmethod
    def kernel(*, shape: tuple[int, ...], value: float, dtype: str) -> Array:
        return np.full(shape, value, dtype=np_dtype(dtype))

    @staticmethod
    def flops(ins: Any, outs: Any, attrs: Any) -> int:
        return 0


def _binary_infer(op: str) -> Any:
    def infer(x: TensorType, y: TensorType) -> TensorType:
        return TensorType(broadcast_shapes(x.shape, y.shape), same_dtype(op, x, y))

    return infer


def _float_samples(*shapes: tuple[int, ...]) -> Any:
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample(tuple(rng.standard_normal(s) for s in shapes))]

    return samples


@defop("add", groups=(ELEMENTWISE, "commutative"))
class Add:
    """Forward: z = x + y. Backward: gx = gz, gy = gz."""

    infer = staticmethod(_binary_infer("add"))
    samples = staticmethod(_float_samples((3, 4), (4,)))

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.add(x, y)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.ct, c.ct)


@defop("mul", groups=(ELEMENTWISE, "commutative"))
class Mul:
    """Forward: z = x * y. Backward: gx = gz * y, gy = gz * x."""

    infer = staticmethod(_binary_infer("mul"))
    samples = staticmethod(_float_samples((3, 4), (3, 1)))

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.multiply(x, y)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, y = c.inputs
        return (
            c.call("mul", c.ct, y) if c.needs[0] else None,
            c.call("mul", c.ct, x) if c.needs[1] else None,
        )
