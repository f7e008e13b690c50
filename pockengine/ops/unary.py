"""Elementwise unary ops: math functions, pow_scalar and cast.

Float math ops (exp, log, tanh, ...) need a float input; neg, abs and pow_scalar
(with an integral exponent >= 0) also take integers. Every kernel
returns an array of its input's dtype (``_like`` also turns the NumPy scalars that
0-d inputs produce back into arrays). VJPs are written in IR ops; ``c.const`` is a
0-d constant that broadcasts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pockengine.ir import (
    DType,
    Fact,
    Sample,
    ShapeError,
    TensorType,
    Value,
    VJPContext,
    defop,
)
from pockengine.ir.arrays import Array
from pockengine.ops._common import EW_INPLACE, np_dtype

__all__: list[str] = []

_EW = Fact.ELEMENTWISE
_ERF = np.frompyfunc(math.erf, 1, 1)  # libm's erf, element by element: slow but exact


# -- helpers ----------------------------------------------------------------
def _float_infer(op: str) -> Callable[[TensorType], TensorType]:
    def infer(x: TensorType) -> TensorType:
        if not x.dtype.is_float:
            raise ShapeError(f"{op} needs a float input, got {x}")
        return x

    return infer


def _numeric_infer(op: str) -> Callable[..., TensorType]:
    def infer(x: TensorType, **attrs: Any) -> TensorType:
        if x.dtype is DType.BOOL:
            raise ShapeError(f"{op} needs a number input, got {x}")
        return x

    return infer


def _like(a: Any, x: Array) -> Array:
    """``a`` as an ndarray of ``x``'s dtype."""
    return np.asarray(a, dtype=x.dtype)


def _erf(x: Array) -> Array:
    return _like(_ERF(x), x)


def _flops(per_element: int) -> Callable[..., int]:
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        return per_element * outs[0].numel

    return flops


def _number(value: object) -> float:
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"expected a number attribute, got {value!r}")


def _away(x: Array, kinks: Sequence[float], margin: float = 0.05) -> Array:
    """Move sample points at least ``margin`` away from the kinks, for finite differences."""
    for k in kinks:
        x = np.where(np.abs(x - k) < margin, k + np.copysign(margin, x - k), x)
    return x


def _uniform(low: float, high: float, kinks: Sequence[float] = ()) -> Callable[..., list[Sample]]:
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((_away(rng.uniform(low, high, (3, 4)), kinks),)),
            Sample((np.asarray(_away(rng.uniform(low, high, ()), kinks)),)),
        ]

    return samples


# -- math functions ---------------------------------------------------------
@defop("neg", facts=EW_INPLACE)
class Neg:
    """Forward: z = -x. Backward: gx = -gz."""

    infer = staticmethod(_numeric_infer("neg"))
    samples = staticmethod(_uniform(-2.0, 2.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.negative(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("neg", c.ct),)


@defop("exp", facts=EW_INPLACE)
class Exp:
    """Forward: z = exp(x). Backward: gx = gz * z."""

    infer = staticmethod(_float_infer("exp"))
    samples = staticmethod(_uniform(-2.0, 2.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.exp(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("mul", c.ct, c.out),)


@defop("log", facts=EW_INPLACE)
class Log:
    """Forward: z = log(x). Backward: gx = gz / x."""

    infer = staticmethod(_float_infer("log"))
    samples = staticmethod(_uniform(0.2, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.log(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("div", c.ct, c.inputs[0]),)


@defop("sqrt", facts=EW_INPLACE)
class Sqrt:
    """Forward: z = sqrt(x). Backward: gx = gz * 0.5 / z."""

    infer = staticmethod(_float_infer("sqrt"))
    samples = staticmethod(_uniform(0.2, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.sqrt(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("div", c.call("mul", c.ct, c.const(0.5, c.ct)), c.out),)


@defop("rsqrt", facts=EW_INPLACE)
class Rsqrt:
    """Forward: z = 1 / sqrt(x). Backward: gx = gz * (-0.5) * z^3."""

    infer = staticmethod(_float_infer("rsqrt"))
    samples = staticmethod(_uniform(0.2, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.reciprocal(np.sqrt(x)), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        y = c.out
        y3 = c.call("mul", y, c.call("mul", y, y))
        return (c.call("mul", c.ct, c.call("mul", y3, c.const(-0.5, y))),)


@defop("tanh", facts=EW_INPLACE)
class Tanh:
    """Forward: z = tanh(x). Backward: gx = gz * (1 - z^2)."""

    infer = staticmethod(_float_infer("tanh"))
    samples = staticmethod(_uniform(-2.0, 2.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.tanh(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        y = c.out
        return (c.call("mul", c.ct, c.call("sub", c.const(1.0, y), c.call("mul", y, y))),)


def _sigmoid(x: Array) -> Array:
    return _like(np.reciprocal(np.exp(-x) + 1.0), x)


@defop("sigmoid", facts=EW_INPLACE)
class Sigmoid:
    """Forward: z = 1 / (1 + exp(-x)). Backward: gx = gz * z * (1 - z)."""

    infer = staticmethod(_float_infer("sigmoid"))
    samples = staticmethod(_uniform(-3.0, 3.0))
    flops = staticmethod(_flops(4))
    kernel = staticmethod(_sigmoid)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        y = c.out
        dy = c.call("mul", y, c.call("sub", c.const(1.0, y), y))
        return (c.call("mul", c.ct, dy),)


@defop("silu", facts=EW_INPLACE)
class Silu:
    """Forward: z = x * s, s = sigmoid(x). Backward: gx = gz * s * (1 + x * (1 - s))."""

    infer = staticmethod(_float_infer("silu"))
    samples = staticmethod(_uniform(-3.0, 3.0))
    flops = staticmethod(_flops(5))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(x * _sigmoid(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        s = c.call("sigmoid", x)
        one = c.const(1.0, x)
        inner = c.call("add", one, c.call("mul", x, c.call("sub", one, s)))
        return (c.call("mul", c.ct, c.call("mul", s, inner)),)


@defop("sin", facts=EW_INPLACE)
class Sin:
    """Forward: z = sin(x). Backward: gx = gz * cos(x)."""

    infer = staticmethod(_float_infer("sin"))
    samples = staticmethod(_uniform(-3.0, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.sin(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("mul", c.ct, c.call("cos", c.inputs[0])),)


@defop("cos", facts=EW_INPLACE)
class Cos:
    """Forward: z = cos(x). Backward: gx = -gz * sin(x)."""

    infer = staticmethod(_float_infer("cos"))
    samples = staticmethod(_uniform(-3.0, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.cos(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("neg", c.call("mul", c.ct, c.call("sin", c.inputs[0]))),)


@defop("abs", facts=EW_INPLACE)
class Abs:
    """Forward: z = |x|. Backward: gx = gz * sign(x), sign(0) = 0 (as ATen's sgn).

    sign(x) is written cast(x > 0) - cast(x < 0).
    """

    infer = staticmethod(_numeric_infer("abs"))
    samples = staticmethod(_uniform(-2.0, 2.0, kinks=(0.0,)))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.abs(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        zero, dtype = c.const(0.0, x), str(x.dtype)
        pos = c.call("cast", c.call("gt", x, zero), dtype=dtype)
        neg = c.call("cast", c.call("lt", x, zero), dtype=dtype)
        return (c.call("mul", c.ct, c.call("sub", pos, neg)),)


@defop("reciprocal", facts=EW_INPLACE)
class Reciprocal:
    """Forward: z = 1 / x. Backward: gx = -gz * z^2."""

    infer = staticmethod(_float_infer("reciprocal"))
    samples = staticmethod(_uniform(0.2, 3.0))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.reciprocal(x), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        y = c.out
        return (c.call("neg", c.call("mul", c.ct, c.call("mul", y, y))),)


@defop("erf", facts=EW_INPLACE)
class Erf:
    """Forward: z = erf(x). Backward: gx = gz * 2/sqrt(pi) * exp(-x^2)."""

    infer = staticmethod(_float_infer("erf"))
    samples = staticmethod(_uniform(-2.0, 2.0))
    flops = staticmethod(_flops(4))
    kernel = staticmethod(_erf)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        gauss = c.call("exp", c.call("neg", c.call("mul", x, x)))
        scaled = c.call("mul", gauss, c.const(2.0 / math.sqrt(math.pi), x))
        return (c.call("mul", c.ct, scaled),)


def _pow_samples(rng: np.random.Generator) -> list[Sample]:
    pos, signed = rng.uniform(0.3, 2.0, (3, 4)), rng.uniform(-2.0, 2.0, (3, 4))
    return [
        Sample((pos,), {"exponent": 0.5}),
        Sample((pos,), {"exponent": -1.5}),
        Sample((signed,), {"exponent": 3}),
        Sample((signed,), {"exponent": 0}),
    ]


@defop("pow_scalar", facts=_EW)
class PowScalar:
    """Forward: z = x ** exponent. Backward: gx = gz * exponent * x ** (exponent - 1)
    (zero when exponent == 0, as ATen). An integer x needs an integer exponent >= 0."""

    samples = staticmethod(_pow_samples)

    @staticmethod
    def infer(x: TensorType, *, exponent: float) -> TensorType:
        if x.dtype.is_float or (float(exponent).is_integer() and exponent >= 0):
            return _numeric_infer("pow_scalar")(x)
        raise ShapeError(f"pow_scalar of {x} needs an integer exponent >= 0, got {exponent}")

    @staticmethod
    def kernel(x: Array, *, exponent: float) -> Array:
        return _like(np.power(x, exponent), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        e = _number(c.attrs["exponent"])
        if e == 0:
            return (c.call("mul", c.ct, c.const(0.0, c.ct)),)
        x = c.inputs[0]
        dx = c.call("mul", c.call("pow_scalar", x, exponent=e - 1), c.const(e, x))
        return (c.call("mul", c.ct, dx),)


@defop("cast", facts=_EW | Fact.VIEW | Fact.SAME_TYPE_IDENTITY)
class Cast:
    """Forward: z = x converted to ``dtype`` (float to int truncates toward zero, to bool is
    x != 0). Backward: gx = cast(gz, x.dtype) when x and z are float; none otherwise."""

    @staticmethod
    def infer(x: TensorType, *, dtype: str) -> TensorType:
        return TensorType(x.shape, DType(dtype))

    @staticmethod
    def kernel(x: Array, *, dtype: str) -> Array:
        return np.asarray(x.astype(np_dtype(dtype)))

    @staticmethod
    def flops(ins: Any, outs: Any, attrs: Any) -> int:
        return 0

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, gz = c.inputs[0], c.cts[0]
        if gz is None or not (x.dtype.is_float and gz.dtype.is_float):
            return (None,)
        return (c.call("cast", gz, dtype=str(x.dtype)),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.uniform(-3.0, 3.0, (3, 4))
        return [
            Sample((x,), {"dtype": "f64"}),
            Sample((x,), {"dtype": "i64"}),
            Sample((x,), {"dtype": "bool"}),
            Sample((rng.random((4,)) < 0.5,), {"dtype": "f32"}),
            Sample((rng.integers(-3, 4, (4,)),), {"dtype": "f32"}),
        ]
