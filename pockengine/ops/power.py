"""Powers and logarithms that need an op of their own: ``log1p`` and ``pow``.

``log1p(x)`` is not ``log(1 + x)``: for |x| below float32's epsilon ``1 + x`` rounds to 1
and the log to 0, while the losses that use it (binary cross-entropy with logits,
``log1p(exp(-|z|))``) need those small values. ``pow(x, y)`` takes a tensor exponent
(``pow_scalar`` in ``unary.py`` has a constant one); BLOOM's ALiBi slopes are
``pow(base, arange)``. Both are elementwise float ops; ``pow`` broadcasts as the binary
ops of ``elementwise.py`` do, and autodiff sums its cotangents back to the input shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import (
    Sample,
    ShapeError,
    TensorType,
    Value,
    VJPContext,
    defop,
)
from pockengine.ir.arrays import Array
from pockengine.ops._common import EW_INPLACE, broadcast_shapes, same_dtype

__all__: list[str] = []


@defop("log1p", facts=EW_INPLACE)
class Log1p:
    """Forward: z = log(1 + x), accurate for small |x|. Backward: gx = gz / (1 + x)."""

    @staticmethod
    def infer(x: TensorType) -> TensorType:
        if not x.dtype.is_float:
            raise ShapeError(f"log1p needs a float input, got {x}")
        return x

    @staticmethod
    def kernel(x: Array) -> Array:
        return np.asarray(np.log1p(x), dtype=x.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        return (c.call("div", c.ct, c.call("add", x, c.const(1.0, x))),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.uniform(-0.5, 3.0, (3, 4)),)),
            Sample((np.asarray(rng.uniform(1e-9, 1e-8)),)),  # where log(1 + x) would be 0
        ]


@defop("pow", facts=EW_INPLACE)
class Pow:
    """Forward: z = x ** y, float operands of one dtype, broadcast.
    Backward (as ATen): gx = gz * y * x ** (y - 1), and 0 where y == 0;
    gy = gz * z * log(x), and 0 where x == 0 and y >= 0 (the limit of z * log(x))."""

    @staticmethod
    def infer(x: TensorType, y: TensorType) -> TensorType:
        if not same_dtype("pow", x, y).is_float:
            raise ShapeError(f"pow needs float operands, got {x}, {y}")
        return TensorType(broadcast_shapes(x.shape, y.shape), x.dtype)

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.power(x, y), dtype=x.dtype)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 2 * outs[0].numel  # exp(y * log(x))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, y = c.inputs
        zero = c.const(0.0, x)
        gx = gy = None
        if c.needs[0]:
            slope = c.call("mul", y, c.call("pow", x, c.call("sub", y, c.const(1.0, y))))
            gx = c.call("where", c.call("eq", y, zero), zero, c.call("mul", c.ct, slope))
        if c.needs[1]:
            flat = c.call("logical_and", c.call("eq", x, zero), c.call("ge", y, zero))
            rate = c.call("where", flat, zero, c.call("mul", c.out, c.call("log", x)))
            gy = c.call("mul", c.ct, rate)
        return (gx, gy)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.uniform(0.5, 2.0, (3, 4)), rng.uniform(-1.5, 1.5, (4,)))),
            Sample((np.asarray(rng.uniform(0.5, 2.0)), rng.uniform(-2.0, 2.0, (2, 3)))),
        ]
