"""Elementwise ops: creation, binary (NumPy broadcasting) and ternary ops.

Binary ops need equal dtypes (the frontends insert casts); a 0-d operand
broadcasts. VJP rules may return a cotangent in the broadcast shape: autodiff
sums it back to the input's shape, once, centrally. Comparisons and logical ops
give bool and are not differentiable. The other unary ops live in ``unary.py`` and
``activation.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pockengine.ir import (
    DType,
    Fact,
    OpDef,
    Sample,
    ShapeError,
    TensorType,
    Value,
    VJPContext,
    defop,
)
from pockengine.ir.arrays import Array
from pockengine.ops._common import EW_INPLACE, broadcast_shapes, np_dtype, same_dtype

__all__: list[str] = []


@defop("full", facts=Fact.CREATION | Fact.CONSTANT)
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


def _arange_length(start: float, stop: float, step: float) -> int:
    if step == 0:
        raise ShapeError("arange needs a step other than 0")
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        return max(0, -((start - stop) // step))  # exact ceil((stop - start) / step)
    return max(0, math.ceil((stop - start) / step))


@defop("arange", facts=Fact.CREATION | Fact.CONSTANT)
class Arange:
    """z[i] = start + i * step for i < ceil((stop - start) / step), as ``np.arange``;
    computed in f64 (or i64) and then converted to ``dtype`` (as ATen). An integer dtype
    needs integral start and step. No inputs, no gradient."""

    @staticmethod
    def infer(*, start: float, stop: float, step: float, dtype: str) -> TensorType:
        dt = DType(dtype)
        if not dt.is_float and not all(float(v).is_integer() for v in (start, step)):
            raise ShapeError(f"arange of dtype {dt} needs integral start and step")
        return TensorType((_arange_length(start, stop, step),), dt)

    @staticmethod
    def kernel(*, start: float, stop: float, step: float, dtype: str) -> Array:
        n = _arange_length(start, stop, step)
        values: Array
        if DType(dtype).is_float:
            values = start + step * np.arange(n, dtype=np.float64)
        else:
            values = int(start) + int(step) * np.arange(n, dtype=np.int64)
        return np.asarray(values.astype(np_dtype(dtype)))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((), {"start": 0, "stop": 7, "step": 2, "dtype": "i64"}),
            Sample((), {"start": 5, "stop": -1, "step": -3, "dtype": "i64"}),
            Sample((), {"start": 0.5, "stop": 2.0, "step": 0.25, "dtype": "f32"}),
            Sample((), {"start": 3, "stop": 3, "step": 1, "dtype": "f64"}),
        ]


_M32 = 0xFFFFFFFF


def _mix32(h: Array) -> Array:
    """A bijection of [0, 2**32) (xorshift-multiply); every product stays below 2**63."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x6A09E667) & _M32
    return h ^ (h >> 16)


def _mask_hash(seed: Array, salt: int, n: int) -> Array:
    s = np.asarray(seed, dtype=np.int64)
    key = _mix32(np.asarray(salt & _M32, dtype=np.int64))
    key = _mix32(_mix32(key ^ (s & _M32)) ^ ((s >> 32) & _M32))
    i = np.arange(n, dtype=np.int64)
    return _mix32(_mix32(key ^ (i & _M32)) ^ (i >> 32))


@defop("random_mask", facts=Fact.CREATION)
class RandomMask:
    """Dropout keep-mask: z = f32(1 / (1 - p)) where element i is kept, 0 where dropped,
    for a counter-based hash of (seed, salt, i), i the row-major flat index. seed is an
    i64 scalar tensor. No gradient.

    The hash uses only int64 arithmetic on values below 2**32 and constants below 2**31,
    so no product overflows and any backend with int64 tensors (torch, JAX with x64)
    reproduces it bit for bit. With M = 0xFFFFFFFF, & on two's complement and >> the
    arithmetic shift (so negative seeds and salts are fine)::

        mix(h), for h in [0, 2**32):      # a bijection of [0, 2**32)
            h = h ^ (h >> 16);  h = (h * 0x7FEB352D) & M
            h = h ^ (h >> 15);  h = (h * 0x6A09E667) & M
            return h ^ (h >> 16)
        key  = mix(mix(mix(salt & M) ^ (seed & M)) ^ ((seed >> 32) & M))
        h[i] = mix(mix(key ^ (i & M)) ^ (i >> 32))    # i >> 32 is 0 below 2**32 elements
        kept = f64(h[i]) / 2**32 >= p                 # exact in f64

    so p = 0 keeps every element and p = 1 drops every one (z = 0).
    """

    @staticmethod
    def infer(seed: TensorType, *, shape: tuple[int, ...], p: float, salt: int) -> TensorType:
        if seed.dtype is not DType.I64 or seed.shape != ():
            raise ShapeError(f"random_mask needs an i64[] seed, got {seed}")
        if not 0.0 <= p <= 1.0:
            raise ShapeError(f"random_mask needs 0 <= p <= 1, got {p}")
        return TensorType(tuple(shape), DType.F32)

    @staticmethod
    def kernel(seed: Array, *, shape: tuple[int, ...], p: float, salt: int) -> Array:
        n = int(np.prod(shape, dtype=np.int64))
        kept = _mask_hash(seed, salt, n).astype(np.float64) / 2.0**32 >= p
        scale = np.float32(1.0 / (1.0 - p) if p < 1.0 else 0.0)
        return np.where(kept, scale, np.float32(0.0)).astype(np.float32).reshape(shape)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        seed = np.asarray(1234, dtype=np.int64)
        return [
            Sample((seed,), {"shape": (3, 4), "p": 0.25, "salt": 1}),
            Sample((seed,), {"shape": (), "p": 0.5, "salt": 0}),
        ]


def _binary_infer(op: str) -> Any:
    def infer(x: TensorType, y: TensorType) -> TensorType:
        return TensorType(broadcast_shapes(x.shape, y.shape), same_dtype(op, x, y))

    return infer


def _float_samples(*shapes: tuple[int, ...]) -> Any:
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample(tuple(rng.standard_normal(s) for s in shapes))]

    return samples


@defop("add", facts=EW_INPLACE | Fact.COMMUTATIVE)
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


@defop("mul", facts=EW_INPLACE | Fact.COMMUTATIVE)
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


@defop("sub", facts=EW_INPLACE)
class Sub:
    """Forward: z = x - y. Backward: gx = gz, gy = -gz."""

    infer = staticmethod(_binary_infer("sub"))
    samples = staticmethod(_float_samples((3, 4), (4,)))

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.subtract(x, y))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.ct if c.needs[0] else None, c.call("neg", c.ct) if c.needs[1] else None)


@defop("div", facts=EW_INPLACE)
class Div:
    """Forward: z = x / y, true division of float operands.
    Backward: gx = gz / y, gy = -gz * z / y."""

    @staticmethod
    def infer(x: TensorType, y: TensorType) -> TensorType:
        if not same_dtype("div", x, y).is_float:
            raise ShapeError(f"div needs float operands, got {x}, {y}")
        return TensorType(broadcast_shapes(x.shape, y.shape), x.dtype)

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.divide(x, y))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        y = c.inputs[1]
        gx = c.call("div", c.ct, y) if c.needs[0] else None
        gy = c.call("neg", c.call("div", c.call("mul", c.ct, c.out), y)) if c.needs[1] else None
        return (gx, gy)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        y = rng.uniform(0.5, 2.0, (4,)) * rng.choice([-1.0, 1.0], (4,))
        return [Sample((rng.standard_normal((3, 4)), y))]


def _select_vjp(c: VJPContext, wins: str) -> Sequence[Value | None]:
    """gx = gz * (cast(x wins) + cast(x == y) / 2), gy = gz - gx: ties split gz evenly."""
    x, y = c.inputs
    dtype = str(c.ct.dtype)
    won = c.call("cast", c.call(wins, x, y), dtype=dtype)
    tied = c.call("cast", c.call("eq", x, y), dtype=dtype)
    share = c.call("add", won, c.call("mul", tied, c.const(0.5, c.ct)))
    gx = c.call("mul", c.ct, share)
    return (gx if c.needs[0] else None, c.call("sub", c.ct, gx) if c.needs[1] else None)


def _untied_samples(rng: np.random.Generator) -> list[Sample]:
    y = rng.standard_normal((4,))
    x = rng.standard_normal((3, 4))
    x = np.where(np.abs(x - y) < 0.05, y + np.copysign(0.05, x - y), x)
    return [Sample((x, y))]


@defop("maximum", facts=EW_INPLACE | Fact.COMMUTATIVE)
class Maximum:
    """Forward: z = max(x, y) (NaN propagates). Backward: gx = gz where x > y, gz/2 where
    x == y, else 0; gy = gz - gx (ties split evenly, as ATen)."""

    infer = staticmethod(_binary_infer("maximum"))
    samples = staticmethod(_untied_samples)

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.maximum(x, y))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return _select_vjp(c, "gt")


@defop("minimum", facts=EW_INPLACE | Fact.COMMUTATIVE)
class Minimum:
    """Forward: z = min(x, y) (NaN propagates). Backward: gx = gz where x < y, gz/2 where
    x == y, else 0; gy = gz - gx (ties split evenly, as ATen)."""

    infer = staticmethod(_binary_infer("minimum"))
    samples = staticmethod(_untied_samples)

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.minimum(x, y))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return _select_vjp(c, "lt")


# -- predicates: bool results, not differentiable -----------------------------
def _predicate_infer(op: str, *, bool_only: bool) -> Callable[..., TensorType]:
    def infer(x: TensorType, y: TensorType) -> TensorType:
        dtype = same_dtype(op, x, y)
        if bool_only and dtype is not DType.BOOL:
            raise ShapeError(f"{op} needs bool operands, got {x}, {y}")
        return TensorType(broadcast_shapes(x.shape, y.shape), DType.BOOL)

    return infer


def _compare_samples(rng: np.random.Generator) -> list[Sample]:
    x, y = rng.integers(-2, 3, (3, 4)), rng.integers(-2, 3, (4,))
    return [Sample((x.astype(np.float64), y.astype(np.float64))), Sample((x, y))]


def _logical_samples(rng: np.random.Generator) -> list[Sample]:
    return [Sample((rng.random((3, 4)) < 0.5, rng.random((4,)) < 0.5))]


def _predicate(
    name: str, expr: str, fn: Callable[[Array, Array], Any], *, bool_only: bool = False
) -> OpDef:
    """Register one predicate; its docstring is 'Forward: z = <expr> (bool)...'."""

    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(fn(x, y))

    body = {
        "__doc__": f"Forward: z = {expr} (bool, broadcast). Not differentiable.",
        "infer": staticmethod(_predicate_infer(name, bool_only=bool_only)),
        "kernel": staticmethod(kernel),
        "samples": staticmethod(_logical_samples if bool_only else _compare_samples),
    }
    commutative = name in ("eq", "ne", "logical_and", "logical_or")
    facts = Fact.ELEMENTWISE | (Fact.COMMUTATIVE if commutative else Fact(0))
    return defop(name, facts=facts)(type(name, (), body))


_predicate("eq", "x == y", np.equal)
_predicate("ne", "x != y", np.not_equal)
_predicate("lt", "x < y", np.less)
_predicate("le", "x <= y", np.less_equal)
_predicate("gt", "x > y", np.greater)
_predicate("ge", "x >= y", np.greater_equal)
_predicate("logical_and", "x and y, on bool", np.logical_and, bool_only=True)
_predicate("logical_or", "x or y, on bool", np.logical_or, bool_only=True)


@defop("logical_not", facts=Fact.ELEMENTWISE)
class LogicalNot:
    """Forward: z = not x, on bool. Not differentiable."""

    @staticmethod
    def infer(x: TensorType) -> TensorType:
        if x.dtype is not DType.BOOL:
            raise ShapeError(f"logical_not needs a bool input, got {x}")
        return x

    @staticmethod
    def kernel(x: Array) -> Array:
        return np.asarray(np.logical_not(x))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample((rng.random((3, 4)) < 0.5,)), Sample((np.asarray(True),))]


@defop("where", facts=Fact.ELEMENTWISE | Fact.CHEAP)
class Where:
    """Forward: z = x where cond else y (cond bool; x, y one dtype; all three broadcast).
    Backward: gcond = none, gx = where(cond, gz, 0), gy = where(cond, 0, gz)."""

    @staticmethod
    def infer(cond: TensorType, x: TensorType, y: TensorType) -> TensorType:
        if cond.dtype is not DType.BOOL:
            raise ShapeError(f"where needs a bool condition, got {cond}")
        dtype = same_dtype("where", x, y)
        return TensorType(broadcast_shapes(cond.shape, x.shape, y.shape), dtype)

    @staticmethod
    def kernel(cond: Array, x: Array, y: Array) -> Array:
        return np.asarray(np.where(cond, x, y))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        cond, zero = c.inputs[0], c.const(0.0, c.ct)
        gx = c.call("where", cond, c.ct, zero) if c.needs[1] else None
        gy = c.call("where", cond, zero, c.ct) if c.needs[2] else None
        return (None, gx, gy)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.random((3, 4)) < 0.5, rng.standard_normal((3, 4)), rng.standard_normal(4))),
            Sample((rng.random((3, 1)) < 0.5, rng.standard_normal((1, 4)), np.asarray(0.5))),
        ]
