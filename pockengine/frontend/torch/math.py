"""ATen converters: elementwise arithmetic, comparisons, unary math, reductions, softmax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pockengine.frontend.compose import elu
from pockengine.frontend.torch.converters import Ctx, aten, axes_of, norm_dim, promote
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


def _arith(op: str) -> Callable[..., Value]:
    def convert(cx: Ctx, a: Any, b: Any, alpha: float = 1) -> Value:
        dtype = cx.out_type.dtype
        x, y = cx.tensor(a, dtype), cx.tensor(b, dtype)
        if alpha != 1:
            y = cx.call("mul", y, cx.full(alpha, dtype))
        return cx.call(op, x, y)

    return convert


aten("add.Tensor", "add.Scalar")(_arith("add"))
aten("sub.Tensor", "sub.Scalar")(_arith("sub"))


@aten("rsub.Scalar", "rsub.Tensor")
def _rsub(cx: Ctx, a: Any, b: Any, alpha: float = 1) -> Value:
    """rsub(a, b, alpha) = b - alpha * a."""
    return _arith("sub")(cx, b, a, alpha)


@aten("mul.Tensor", "mul.Scalar")
def _mul(cx: Ctx, a: Any, b: Any) -> Value:
    dtype = cx.out_type.dtype
    if dtype is DType.BOOL:
        return cx.call("logical_and", cx.tensor(a, dtype), cx.tensor(b, dtype))
    return cx.call("mul", cx.tensor(a, dtype), cx.tensor(b, dtype))


@aten("div.Tensor", "div.Scalar")
def _div(cx: Ctx, a: Any, b: Any) -> Value:
    dtype = cx.out_type.dtype
    return cx.call("div", cx.tensor(a, dtype), cx.tensor(b, dtype))


@aten("div.Tensor_mode")
def _div_mode(cx: Ctx, a: Any, b: Any, rounding_mode: str | None = None) -> Value:
    if rounding_mode is not None:
        raise CompileError(f"division with rounding_mode={rounding_mode!r} is not supported")
    return _div(cx, a, b)


def _binary_same(op: str) -> Any:
    def convert(cx: Ctx, a: Any, b: Any) -> Value:
        dtype = cx.out_type.dtype
        return cx.call(op, cx.tensor(a, dtype), cx.tensor(b, dtype))

    return convert


aten("maximum.default")(_binary_same("maximum"))
aten("minimum.default")(_binary_same("minimum"))


def _compare(op: str) -> Any:
    def convert(cx: Ctx, a: Any, b: Any) -> Value:
        dtype = promote(a, b)
        return cx.call(op, cx.tensor(a, dtype), cx.tensor(b, dtype))

    return convert


for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    aten(f"{_op}.Tensor", f"{_op}.Scalar")(_compare(_op))


def _logical(op: str) -> Any:
    def convert(cx: Ctx, a: Any, b: Any) -> Value:
        return cx.call(op, cx.tensor(a, DType.BOOL), cx.tensor(b, DType.BOOL))

    return convert


aten("logical_and.default")(_logical("logical_and"))
aten("logical_or.default")(_logical("logical_or"))


def _bitwise(op: str) -> Any:
    def convert(cx: Ctx, a: Any, b: Any) -> Value:
        if cx.out_type.dtype is not DType.BOOL:
            raise CompileError("bitwise ops are supported on bool tensors only")
        return cx.call(op, cx.tensor(a, DType.BOOL), cx.tensor(b, DType.BOOL))

    return convert


aten("bitwise_and.Tensor")(_bitwise("logical_and"))
aten("bitwise_or.Tensor")(_bitwise("logical_or"))


@aten("logical_not.default", "bitwise_not.default")
def _not(cx: Ctx, a: Value) -> Value:
    if cx.out_type.dtype is not DType.BOOL:
        raise CompileError("bitwise_not is supported on bool tensors only")
    return cx.call("logical_not", cx.cast(a, DType.BOOL))


@aten("where.self")
def _where(cx: Ctx, cond: Value, a: Any, b: Any) -> Value:
    dtype = cx.out_type.dtype
    return cx.call("where", cx.cast(cond, DType.BOOL), cx.tensor(a, dtype), cx.tensor(b, dtype))


def _unary(op: str) -> Any:
    def convert(cx: Ctx, a: Value) -> Value:
        return cx.call(op, cx.cast(a, cx.out_type.dtype))

    return convert


for _op in (
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "relu",
    "silu",
    "sin",
    "cos",
    "abs",
    "reciprocal",
    "erf",
    "log1p",
):
    aten(f"{_op}.default")(_unary(_op))


@aten("gelu.default")
def _gelu(cx: Ctx, a: Value, approximate: str = "none") -> Value:
    return cx.call("gelu", a, approximate=approximate)


@aten("hardtanh.default")
def _hardtanh(cx: Ctx, a: Value, min_val: float = -1.0, max_val: float = 1.0) -> Value:
    return cx.call("hardtanh", a, min_val=float(min_val), max_val=float(max_val))


@aten("clamp.default")
def _clamp(cx: Ctx, a: Value, min: float | None = None, max: float | None = None) -> Value:
    lo = None if min is None else float(min)
    hi = None if max is None else float(max)
    return cx.call("clamp", a, min=lo, max=hi)


@aten("clamp_min.default")
def _clamp_min(cx: Ctx, a: Value, min: float) -> Value:
    return cx.call("clamp", a, min=float(min), max=None)


@aten("pow.Tensor_Scalar")
def _pow(cx: Ctx, a: Value, exponent: float) -> Value:
    a = cx.cast(a, cx.out_type.dtype)
    if exponent == 2:
        return cx.call("mul", a, a)
    return cx.call("pow_scalar", a, exponent=float(exponent))


@aten("pow.Tensor_Tensor", "pow.Scalar")
def _pow_tensor(cx: Ctx, a: Any, exponent: Any) -> Value:
    """A tensor exponent (or a scalar base): the IR's float ``pow`` in the result dtype."""
    dtype = cx.out_type.dtype
    if not dtype.is_float:
        raise CompileError(
            f"pow with a tensor exponent gives {dtype}: only float results are supported"
        )
    return cx.call("pow", cx.tensor(a, dtype), cx.tensor(exponent, dtype))


# -- reductions -------------------------------------------------------------------


def _with_dtype(cx: Ctx, a: Value, dtype: Any) -> Value:
    return a if dtype is None else cx.cast(a, cx.out_type.dtype)


@aten("sum.dim_IntList", "sum.default")
def _sum(cx: Ctx, a: Value, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Value:
    a = _with_dtype(cx, a, dtype)
    return cx.cast(
        cx.call("sum", a, axes=axes_of(dim, a.type.rank), keepdims=keepdim), cx.out_type.dtype
    )


@aten("mean.dim", "mean.default")
def _mean(cx: Ctx, a: Value, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Value:
    a = _with_dtype(cx, a, dtype)
    return cx.call("mean", a, axes=axes_of(dim, a.type.rank), keepdims=keepdim)


@aten("amax.default")
def _amax(cx: Ctx, a: Value, dim: Any = (), keepdim: bool = False) -> Value:
    return cx.call("amax", a, axes=axes_of(dim, a.type.rank), keepdims=keepdim)


@aten("any.dim", "any.dims", "any.default")
def _any(cx: Ctx, a: Value, dim: Any = None, keepdim: bool = False) -> Value:
    a = cx.cast(a, DType.BOOL)
    return cx.call("any", a, axes=axes_of(dim, a.type.rank), keepdims=keepdim)


@aten("_softmax.default")
def _softmax(cx: Ctx, a: Value, dim: int, half_to_float: bool = False) -> Value:
    return cx.call("softmax", a, axis=norm_dim(dim, a.type.rank))


@aten("_safe_softmax.default")
def _safe_softmax(cx: Ctx, a: Value, dim: int, dtype: Any = None) -> Value:
    a = _with_dtype(cx, a, dtype)
    return cx.call("safe_softmax", a, axis=norm_dim(dim, a.type.rank))


@aten("_log_softmax.default")
def _log_softmax(cx: Ctx, a: Value, dim: int, half_to_float: bool = False) -> Value:
    return cx.call("log_softmax", a, axis=norm_dim(dim, a.type.rank))


@aten("cumsum.default")
def _cumsum(cx: Ctx, a: Value, dim: int, dtype: Any = None) -> Value:
    a = _with_dtype(cx, a, dtype)
    return cx.cast(cx.call("cumsum", a, axis=norm_dim(dim, a.type.rank)), cx.out_type.dtype)


@aten("clamp.Tensor")
def _clamp_tensor(cx: Ctx, a: Value, min: Any = None, max: Any = None) -> Value:
    dtype = cx.out_type.dtype
    out = cx.cast(a, dtype)
    if min is not None:
        out = cx.call("maximum", out, cx.tensor(min, dtype))
    if max is not None:
        out = cx.call("minimum", out, cx.tensor(max, dtype))
    return out


@aten("leaky_relu.default")
def _leaky_relu(cx: Ctx, a: Value, negative_slope: float = 0.01) -> Value:
    """leaky_relu(x) = x where x > 0, else slope * x."""
    zero = cx.full(0.0, a.dtype)
    scaled = cx.call("mul", a, cx.full(float(negative_slope), a.dtype))
    return cx.call("where", cx.call("gt", a, zero), a, scaled)


@aten("elu.default")
def _elu(
    cx: Ctx, a: Value, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> Value:
    return elu(cx, a, alpha, scale, input_scale)


@aten("isnan.default")
def _isnan(cx: Ctx, a: Value) -> Value:
    """NaN is the one value not equal to itself."""
    return cx.call("ne", a, a)


@aten("isinf.default")
def _isinf(cx: Ctx, a: Value) -> Value:
    if not a.dtype.is_float:
        return cx.full(False, DType.BOOL, a.shape)
    return cx.call("eq", cx.call("abs", a), cx.full(float("inf"), a.dtype))
