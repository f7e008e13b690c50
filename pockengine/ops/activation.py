"""Piecewise activations and their backward kernels: relu, gelu, clamp, hardtanh.

``relu_grad``, ``gelu_grad`` and ``hardtanh_grad`` are backward kernels (no VJP of their
own); the adjoint tests of relu, gelu and hardtanh check them. clamp and hardtanh compute the same
values and differ only at the bounds of their gradient: clamp passes it where
min <= x <= max (ATen's clamp_backward), hardtanh strictly inside
min_val < x < max_val (ATen's hardtanh_backward, which relu6 also uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pockengine.ir import Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, same_dtype
from pockengine.ops.unary import _away, _erf, _flops, _like, _number, _numeric_infer, _uniform

__all__: list[str] = []

_EW = Fact.ELEMENTWISE
_EW_INPLACE = Fact.ELEMENTWISE | Fact.INPLACE  # the result may overwrite a dying input
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_KAPPA = 0.044715
_GELU_MODES = ("none", "tanh")


def _check_gelu_mode(approximate: str) -> None:
    if approximate not in _GELU_MODES:
        raise ShapeError(f"gelu approximate={approximate!r} is not one of {_GELU_MODES}")


def _grad_infer(op: str, *, float_only: bool) -> Callable[..., TensorType]:
    """Shape rule of a backward kernel (gz, saved): equal dtypes, broadcast shapes."""

    def infer(gz: TensorType, saved: TensorType, **attrs: object) -> TensorType:
        dtype = same_dtype(op, gz, saved)
        if float_only and not dtype.is_float:
            raise ShapeError(f"{op} needs float inputs, got {gz}, {saved}")
        if "approximate" in attrs:
            _check_gelu_mode(str(attrs["approximate"]))
        return TensorType(broadcast_shapes(gz.shape, saved.shape), dtype)

    return infer


def _grad_samples(kinks: Sequence[float], **attrs: object) -> Callable[..., list[Sample]]:
    def samples(rng: np.random.Generator) -> list[Sample]:
        saved = _away(rng.uniform(-3.0, 3.0, (3, 4)), kinks)
        return [Sample((rng.standard_normal((3, 4)), saved), dict(attrs))]

    return samples


# -- relu -------------------------------------------------------------------
@defop("relu", facts=_EW | Fact.CHEAP)
class Relu:
    """Forward: z = max(x, 0). Backward: gx = relu_grad(gz, z), i.e. gz where z > 0, else 0."""

    infer = staticmethod(_numeric_infer("relu"))
    samples = staticmethod(_uniform(-2.0, 2.0, kinks=(0.0,)))

    @staticmethod
    def kernel(x: Array) -> Array:
        return _like(np.maximum(x, 0), x)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("relu_grad", c.ct, c.out),)


@defop("relu_grad", facts=_EW_INPLACE)
class ReluGrad:
    """Backward kernel of relu: gx = gz where y > 0, else 0 (y = relu(x) or x)."""

    infer = staticmethod(_grad_infer("relu_grad", float_only=False))
    samples = staticmethod(_grad_samples(kinks=(0.0,)))

    @staticmethod
    def kernel(gz: Array, y: Array) -> Array:
        return _like(np.where(y > 0, gz, np.zeros((), gz.dtype)), gz)


# -- gelu -------------------------------------------------------------------
def _gelu(x: Array, approximate: str) -> Array:
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + _GELU_KAPPA * x * x * x)
        return _like(0.5 * x * (1.0 + np.tanh(inner)), x)
    return _like(0.5 * x * (1.0 + _erf(x * _INV_SQRT_2)), x)


def _gelu_derivative(x: Array, approximate: str) -> Array:
    if approximate == "tanh":
        x2 = x * x
        t = np.tanh(_SQRT_2_OVER_PI * (x + _GELU_KAPPA * x2 * x))
        dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_KAPPA * x2)
        return _like(0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner, x)
    cdf = 0.5 * (1.0 + _erf(x * _INV_SQRT_2))
    pdf = np.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return _like(cdf + x * pdf, x)


@defop("gelu", facts=_EW_INPLACE | Fact.CHEAP)
class Gelu:
    """Forward: z = x * Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2 (approximate='none'), or
    z = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (approximate='tanh').
    Backward: gx = gelu_grad(gz, x, approximate)."""

    flops = staticmethod(_flops(8))

    @staticmethod
    def infer(x: TensorType, *, approximate: str) -> TensorType:
        _check_gelu_mode(approximate)
        if not x.dtype.is_float:
            raise ShapeError(f"gelu needs a float input, got {x}")
        return x

    @staticmethod
    def kernel(x: Array, *, approximate: str) -> Array:
        return _gelu(x, approximate)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("gelu_grad", c.ct, c.inputs[0], approximate=c.attrs["approximate"]),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.uniform(-3.0, 3.0, (3, 4))
        return [
            Sample((x,), {"approximate": "none"}),
            Sample((x,), {"approximate": "tanh"}),
            Sample((np.asarray(0.7),), {"approximate": "none"}),
        ]


@defop("gelu_grad", facts=_EW_INPLACE)
class GeluGrad:
    """Backward kernel of gelu: gx = gz * d gelu(x) / dx. For approximate='none',
    d/dx = Phi(x) + x * phi(x) with phi(x) = exp(-x^2/2) / sqrt(2 pi); for 'tanh', with
    t = tanh(k (x + 0.044715 x^3)), k = sqrt(2/pi):
    d/dx = (1 + t)/2 + x/2 * (1 - t^2) * k * (1 + 3 * 0.044715 x^2)."""

    infer = staticmethod(_grad_infer("gelu_grad", float_only=True))
    samples = staticmethod(_grad_samples(kinks=(), approximate="tanh"))
    flops = staticmethod(_flops(12))

    @staticmethod
    def kernel(gz: Array, x: Array, *, approximate: str) -> Array:
        return _like(gz * _gelu_derivative(x, approximate), gz)


# -- clamp and hardtanh -----------------------------------------------------
def _clip(x: Array, low: float | None, high: float | None) -> Array:
    z = x
    if low is not None:
        z = np.maximum(z, low)
    if high is not None:
        z = np.minimum(z, high)
    return _like(z, x)


def _pass_between(c: VJPContext, low: object, high: object) -> Value:
    """gz where low <= x <= high (bounds that are None are absent), else 0."""
    x = c.inputs[0]
    mask: Value | None = None
    for bound, op in ((low, "ge"), (high, "le")):
        if bound is None:
            continue
        inside = c.call(op, x, c.const(_number(bound), x))
        mask = inside if mask is None else c.call("logical_and", mask, inside)
    if mask is None:
        return c.ct
    return c.call("where", mask, c.ct, c.const(0.0, c.ct))


@defop("clamp", facts=_EW_INPLACE | Fact.CHEAP)
class Clamp:
    """Forward: z = min(max(x, min), max); a bound that is None is absent; min > max gives max
    (as ATen). The result keeps x's dtype: an integer x wants integer bounds.
    Backward: gx = gz where min <= x <= max, else 0 (ATen's clamp_backward)."""

    infer = staticmethod(_numeric_infer("clamp"))
    flops = staticmethod(_flops(2))

    @staticmethod
    def kernel(x: Array, *, min: float | None, max: float | None) -> Array:
        return _clip(x, min, max)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (_pass_between(c, c.attrs["min"], c.attrs["max"]),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        def x(*kinks: float) -> Array:
            return _away(rng.uniform(-1.5, 1.5, (3, 4)), kinks)

        return [
            Sample((x(-0.5, 0.5),), {"min": -0.5, "max": 0.5}),
            Sample((x(0.3),), {"min": None, "max": 0.3}),
            Sample((x(-0.2),), {"min": -0.2, "max": None}),
        ]


@defop("hardtanh", facts=_EW_INPLACE | Fact.CHEAP)
class Hardtanh:
    """Forward: z = min(max(x, min_val), max_val) (relu6 is hardtanh(0, 6)).
    Backward: gx = gz where min_val < x < max_val, else 0 (ATen's hardtanh_backward)."""

    infer = staticmethod(_numeric_infer("hardtanh"))
    flops = staticmethod(_flops(2))

    @staticmethod
    def kernel(x: Array, *, min_val: float, max_val: float) -> Array:
        return _clip(x, min_val, max_val)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        # z = clip(x) lies strictly inside the bounds exactly when x does, so the backward
        # reads the output (which the next layer saves anyway), not the input.
        bounds = {"min_val": c.attrs["min_val"], "max_val": c.attrs["max_val"]}
        return (c.call("hardtanh_grad", c.ct, c.out, **bounds),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = _away(rng.uniform(-2.0, 8.0, (3, 4)), (0.0, 6.0))
        return [Sample((x,), {"min_val": 0.0, "max_val": 6.0})]


@defop("hardtanh_grad", facts=_EW_INPLACE)
class HardtanhGrad:
    """Backward kernel of hardtanh: gx = gz where min_val < y < max_val, else 0, with y the
    input or the output of hardtanh (ATen's hardtanh_backward)."""

    infer = staticmethod(_grad_infer("hardtanh_grad", float_only=True))
    samples = staticmethod(_grad_samples(kinks=(-1.0, 2.0), min_val=-1.0, max_val=2.0))
    flops = staticmethod(_flops(2))

    @staticmethod
    def kernel(gz: Array, y: Array, *, min_val: float, max_val: float) -> Array:
        inside = (y > min_val) & (y < max_val)
        return _like(np.where(inside, gz, np.zeros((), gz.dtype)), gz)
