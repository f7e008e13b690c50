"""JAX converters: elementwise arithmetic, comparisons, unary math, selection, reductions."""

from __future__ import annotations

import math
from collections.abc import Callable

from pockengine.frontend import compose
from pockengine.frontend.jax.converters import JCtx, norm_axes, primitive
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


def _same_dtype(cx: JCtx, *xs: Value) -> list[Value]:
    """Operands cast to the result's dtype (jaxprs already agree; weak literals may not)."""
    dtype = cx.out_type.dtype
    return [cx.cast(x, dtype) for x in xs]


def _binary(op: str) -> Callable[..., Value]:
    def convert(cx: JCtx, x: Value, y: Value) -> Value:
        return cx.call(op, *_same_dtype(cx, x, y))

    return convert


# add_any: how JAX's own transpose sums cotangents (a loss_fn that takes jax.grad inside)
_BINARY = (("add", "add"), ("add_any", "add"), ("sub", "sub"), ("max", "maximum"),
           ("min", "minimum"))  # fmt: skip
for _prim, _op in _BINARY:
    primitive(_prim)(_binary(_op))


@primitive("mul")
def _mul(cx: JCtx, x: Value, y: Value) -> Value:
    if cx.out_type.dtype is DType.BOOL:
        return cx.call("logical_and", x, y)
    return cx.call("mul", *_same_dtype(cx, x, y))


@primitive("div")
def _div(cx: JCtx, x: Value, y: Value) -> Value:
    if not cx.out_type.dtype.is_float:
        raise CompileError("integer division is not supported (IR div is true division)")
    return cx.call("div", *_same_dtype(cx, x, y))


def _compare(op: str) -> Callable[..., Value]:
    def convert(cx: JCtx, x: Value, y: Value) -> Value:
        dtype = x.dtype if x.type.rank >= y.type.rank else y.dtype
        return cx.call(op, cx.cast(x, dtype), cx.cast(y, dtype))

    return convert


for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    primitive(_op)(_compare(_op))


def _logical(op: str) -> Callable[..., Value]:
    def convert(cx: JCtx, x: Value, y: Value) -> Value:
        if cx.out_type.dtype is not DType.BOOL:
            raise CompileError(f"bitwise {op} is supported on bool tensors only")
        return cx.call(op, x, y)

    return convert


primitive("and")(_logical("logical_and"))
primitive("or")(_logical("logical_or"))


@primitive("not")
def _not(cx: JCtx, x: Value) -> Value:
    if x.dtype is not DType.BOOL:
        raise CompileError("bitwise not is supported on bool tensors only")
    return cx.call("logical_not", x)


def _unary(op: str) -> Callable[..., Value]:
    def convert(cx: JCtx, x: Value) -> Value:
        return cx.call(op, x)

    return convert


for _prim, _op in (
    ("neg", "neg"),
    ("exp", "exp"),
    ("log", "log"),
    ("sqrt", "sqrt"),
    ("rsqrt", "rsqrt"),
    ("tanh", "tanh"),
    ("logistic", "sigmoid"),
    ("erf", "erf"),
    ("abs", "abs"),
    ("sin", "sin"),
    ("cos", "cos"),
):
    primitive(_prim)(_unary(_op))


@primitive("square")
def _square(cx: JCtx, x: Value) -> Value:
    return cx.call("mul", x, x)


@primitive("erfc")
def _erfc(cx: JCtx, x: Value) -> Value:
    return cx.call("sub", cx.full(1.0, x.dtype), cx.call("erf", x))


@primitive("log1p")
def _log1p(cx: JCtx, x: Value) -> Value:
    return cx.call("log1p", x)


@primitive("expm1")
def _expm1(cx: JCtx, x: Value) -> Value:
    return cx.call("sub", cx.call("exp", x), cx.full(1.0, x.dtype))


@primitive("exp2")
def _exp2(cx: JCtx, x: Value) -> Value:
    return cx.call("exp", cx.call("mul", x, cx.full(math.log(2.0), x.dtype)))


@primitive("integer_pow")
def _integer_pow(cx: JCtx, x: Value) -> Value:
    y = int(cx.params["y"])
    if y == 0:
        return cx.full(1, x.dtype, x.shape)
    if y == 1:
        return x
    if y == 2:
        return cx.call("mul", x, x)
    return cx.call("pow_scalar", x, exponent=float(y))


@primitive("pow")
def _pow(cx: JCtx, x: Value, y: Value) -> Value:
    """A constant scalar exponent is ``pow_scalar``; a computed one the float ``pow``."""
    known = cx.known.get(y.name)
    if known is not None and known.size == 1:
        return cx.call("pow_scalar", x, exponent=float(known.reshape(())))
    return cx.call("pow", x, cx.cast(y, x.dtype))


@primitive("sign")
def _sign(cx: JCtx, x: Value) -> Value:
    zero = cx.full(0, x.dtype)
    pos = cx.cast(cx.call("gt", x, zero), x.dtype)
    neg = cx.cast(cx.call("lt", x, zero), x.dtype)
    return cx.call("sub", pos, neg)


@primitive("is_finite")
def _is_finite(cx: JCtx, x: Value) -> Value:
    not_nan = cx.call("eq", x, x)
    not_inf = cx.call("ne", cx.call("abs", x), cx.full(math.inf, x.dtype))
    return cx.call("logical_and", not_nan, not_inf)


@primitive("select_n")
def _select_n(cx: JCtx, which: Value, *cases: Value) -> Value:
    """select_n(p, a, b) is b where p else a (for a bool p); an int p picks case p."""
    dtype = cx.out_type.dtype
    cases_c = [cx.cast(c, dtype) for c in cases]
    if len(cases_c) == 1:
        return cases_c[0]
    if which.dtype is DType.BOOL:
        return cx.call("where", which, cases_c[1], cases_c[0])
    out = cases_c[0]
    for k, case in enumerate(cases_c[1:], start=1):
        pick = cx.call("eq", which, cx.full(k, which.dtype))
        out = cx.call("where", pick, case, out)
    return out


@primitive("clamp")
def _clamp(cx: JCtx, lo: Value, x: Value, hi: Value) -> Value:
    return cx.call("minimum", cx.call("maximum", x, cx.cast(lo, x.dtype)), cx.cast(hi, x.dtype))


@primitive("convert_element_type")
def _convert(cx: JCtx, x: Value) -> Value:
    return cx.cast(x, cx.out_type.dtype)


@primitive("copy", "copy_p", "optimization_barrier")
def _identity(cx: JCtx, *xs: Value) -> tuple[Value, ...]:
    return xs


@primitive("stop_gradient")
def _stop_gradient(cx: JCtx, x: Value) -> Value:
    # Integers never get cotangents: nothing to stop.
    return cx.call("stop_gradient", x) if x.dtype.is_float else x


# -- reductions -------------------------------------------------------------------


def _axes(cx: JCtx, x: Value) -> tuple[int, ...]:
    return norm_axes(cx.params["axes"], x.type.rank)


@primitive("reduce_sum")
def _reduce_sum(cx: JCtx, x: Value) -> Value:
    axes = _axes(cx, x)
    if not axes:
        return x
    return cx.cast(cx.call("sum", x, axes=axes, keepdims=False), cx.out_type.dtype)


@primitive("reduce_max")
def _reduce_max(cx: JCtx, x: Value) -> Value:
    axes = _axes(cx, x)
    return cx.call("amax", x, axes=axes, keepdims=False) if axes else x


@primitive("reduce_min")
def _reduce_min(cx: JCtx, x: Value) -> Value:
    axes = _axes(cx, x)
    if not axes:
        return x
    return compose.amin(cx, x, axes, False)


@primitive("reduce_or")
def _reduce_or(cx: JCtx, x: Value) -> Value:
    return cx.call("any", x, axes=_axes(cx, x), keepdims=False)


@primitive("reduce_and")
def _reduce_and(cx: JCtx, x: Value) -> Value:
    none_false = cx.call("any", cx.call("logical_not", x), axes=_axes(cx, x), keepdims=False)
    return cx.call("logical_not", none_false)


@primitive("argmax")
def _argmax(cx: JCtx, x: Value) -> Value:
    return _first_top(cx, x)


@primitive("argmin")
def _argmin(cx: JCtx, x: Value) -> Value:
    return _first_top(cx, cx.call("neg", x))


def _first_top(cx: JCtx, values: Value) -> Value:
    """The first index of the largest value: min over the axis of where(x == max, i, n)."""
    (axis,) = _axes(cx, values)
    n = values.shape[axis]
    top = cx.call("amax", values, axes=(axis,), keepdims=True)
    index = cx.call("arange", start=0, stop=n, step=1, dtype=str(DType.I64))
    shape = tuple(n if d == axis else 1 for d in range(values.type.rank))
    index = cx.broadcast(cx.reshape(index, shape), values.shape)
    masked = cx.call("where", cx.call("eq", values, top), index, cx.full(n, DType.I64))
    first = cx.call("neg", cx.call("amax", cx.call("neg", masked), axes=(axis,), keepdims=False))
    return cx.cast(first, cx.out_type.dtype)


@primitive("cumsum")
def _cumsum(cx: JCtx, x: Value) -> Value:
    if cx.params.get("reverse"):
        raise CompileError("reverse cumsum is not supported")
    axis = int(cx.params["axis"]) % max(x.type.rank, 1)
    return cx.cast(cx.call("cumsum", x, axis=axis), cx.out_type.dtype)


@primitive("reduce_prod")
def _reduce_prod(cx: JCtx, x: Value) -> Value:
    """A product as a chain of multiplies over the reduced elements (exact gradients where
    an element is zero), for at most 64 of them per result."""
    axes = _axes(cx, x)
    if not axes:
        return x
    kept = [a for a in range(x.type.rank) if a not in axes]
    count = 1
    for a in axes:
        count *= x.shape[a]
    if count > 64:
        raise CompileError(f"a product over {count} elements (more than 64)")
    flat = cx.reshape(cx.transpose(x, (*kept, *axes)), (*(x.shape[a] for a in kept), count))
    last = flat.type.rank - 1
    out = cx.call("slice", flat, axis=last, start=0, stop=1, step=1)
    for i in range(1, count):
        out = cx.call("mul", out, cx.call("slice", flat, axis=last, start=i, stop=i + 1, step=1))
    return cx.reshape(out, cx.out_type.shape)
