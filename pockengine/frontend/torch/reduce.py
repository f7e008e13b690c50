"""ATen converters: reductions the IR composes from its own ops (arg-max and -min, max and
min along a dim, variance and standard deviation, products, vector norms).

Each is built from ``amax``, ``sum``, ``mean``, ``where`` and elementwise ops, so every
backend runs it and autodiff differentiates it with no op of its own.
"""

from __future__ import annotations

from typing import Any

from pockengine.frontend.compose import amin, arg_extreme, l2_norm
from pockengine.frontend.torch.converters import Ctx, aten, axes_of, norm_dim
from pockengine.ir import CompileError, Value

__all__: list[str] = []

_MAX_PRODUCT = 64  # a product is unrolled into this many multiplies at most


def _flat(cx: Ctx, a: Value) -> Value:
    return cx.call("reshape", a, shape=(a.type.numel,))


def _first_index(cx: Ctx, a: Value, axis: int, keepdim: bool, lowest: bool) -> Value:
    """The index of the first maximum (``lowest``: minimum) along ``axis``, as ATen's."""
    return arg_extreme(cx, a, axis, keepdim, lowest)


def _arg(lowest: bool) -> Any:
    def convert(cx: Ctx, a: Value, dim: int | None = None, keepdim: bool = False) -> Value:
        if dim is None:
            out = _first_index(cx, _flat(cx, a), 0, False, lowest)
            return cx.call("reshape", out, shape=cx.out_type.shape)
        return _first_index(cx, a, norm_dim(dim, a.type.rank), keepdim, lowest)

    return convert


aten("argmax.default")(_arg(lowest=False))
aten("argmin.default")(_arg(lowest=True))


def _along(lowest: bool) -> Any:
    def convert(cx: Ctx, a: Value, dim: int, keepdim: bool = False) -> tuple[Value, Value]:
        """(values, indices) along ``dim``; dead-code elimination drops unread indices."""
        axis = norm_dim(dim, a.type.rank)
        if lowest:
            values = amin(cx, a, (axis,), keepdim)
        else:
            values = cx.call("amax", a, axes=(axis,), keepdims=keepdim)
        return values, _first_index(cx, a, axis, keepdim, lowest)

    return convert


aten("max.dim")(_along(lowest=False))
aten("min.dim")(_along(lowest=True))


@aten("max.default")
def _max_all(cx: Ctx, a: Value) -> Value:
    return cx.call("amax", a, axes=None, keepdims=False)


@aten("min.default")
def _min_all(cx: Ctx, a: Value) -> Value:
    return amin(cx, a, None, False)


@aten("amin.default")
def _amin_dims(cx: Ctx, a: Value, dim: Any = (), keepdim: bool = False) -> Value:
    return amin(cx, a, axes_of(dim, a.type.rank), keepdim)


def _count(a: Value, axes: tuple[int, ...] | None) -> int:
    if axes is None:
        return a.type.numel
    n = 1
    for ax in axes:
        n *= a.shape[ax]
    return n


def _variance(
    cx: Ctx, a: Value, dim: Any, correction: float | None, keepdim: bool
) -> tuple[Value, Value]:
    """(var, mean) over ``dim`` with Bessel's ``correction`` (default 1), as ATen."""
    if not a.dtype.is_float:
        raise CompileError(f"variance of a {a.dtype} tensor: cast it to float first")
    axes = axes_of(dim, a.type.rank)
    mean = cx.call("mean", a, axes=axes, keepdims=True)
    centred = cx.call("sub", a, mean)
    squares = cx.call("sum", cx.call("mul", centred, centred), axes=axes, keepdims=keepdim)
    dof = _count(a, axes) - (1.0 if correction is None else float(correction))
    var = cx.call("div", squares, cx.full(max(dof, 0.0), a.dtype))
    if not keepdim:
        mean = cx.call("reshape", mean, shape=var.shape)
    return var, mean


@aten("var.correction", "var.dim")
def _var(
    cx: Ctx, a: Value, dim: Any = None, *args: Any, correction: Any = None, keepdim: bool = False
) -> Value:
    correction, keepdim = _correction(args, correction, keepdim)
    return _variance(cx, a, dim, correction, keepdim)[0]


@aten("std.correction", "std.dim")
def _std(
    cx: Ctx, a: Value, dim: Any = None, *args: Any, correction: Any = None, keepdim: bool = False
) -> Value:
    correction, keepdim = _correction(args, correction, keepdim)
    return cx.call("sqrt", _variance(cx, a, dim, correction, keepdim)[0])


@aten("var_mean.correction", "var_mean.dim")
def _var_mean(
    cx: Ctx, a: Value, dim: Any = None, *args: Any, correction: Any = None, keepdim: bool = False
) -> tuple[Value, Value]:
    correction, keepdim = _correction(args, correction, keepdim)
    return _variance(cx, a, dim, correction, keepdim)


def _correction(args: tuple[Any, ...], correction: Any, keepdim: bool) -> tuple[Any, bool]:
    """The ``.dim`` overloads pass (unbiased, keepdim) positionally; ``.correction`` passes
    (correction, keepdim) as keywords."""
    if args:
        unbiased = args[0]
        correction = 1 if unbiased is None or unbiased is True else 0
        keepdim = bool(args[1]) if len(args) > 1 else keepdim
    return correction, keepdim


@aten("prod.dim_int", "prod.default")
def _prod(
    cx: Ctx, a: Value, dim: int | None = None, keepdim: bool = False, dtype: Any = None
) -> Value:
    """A product as a chain of multiplies along the axis (exact gradients where elements
    are zero, as ATen's), for axes of at most 64 elements."""
    dtype_out = cx.out_type.dtype
    x = cx.cast(_flat(cx, a) if dim is None else a, dtype_out)
    axis = 0 if dim is None else norm_dim(dim, a.type.rank)
    n = x.shape[axis] if x.type.rank else 1
    if n > _MAX_PRODUCT:
        raise CompileError(f"a product over {n} elements (more than {_MAX_PRODUCT})")
    if n == 0:
        return cx.full(1, dtype_out, cx.out_type.shape)
    parts = [cx.call("slice", x, axis=axis, start=i, stop=i + 1, step=1) for i in range(n)]
    out = parts[0]
    for p in parts[1:]:
        out = cx.call("mul", out, p)
    return cx.call("reshape", out, shape=cx.out_type.shape)


@aten("linalg_vector_norm.default")
def _vector_norm(
    cx: Ctx, a: Value, ord: float = 2, dim: Any = None, keepdim: bool = False, dtype: Any = None
) -> Value:
    """The p-norm over ``dim``. The 2-norm's square root reads max(sum, tiny), so a zero
    vector gets gradient 0 (ATen's choice), not 0/0."""
    x = cx.cast(a, cx.out_type.dtype)
    axes = axes_of(dim, x.type.rank)
    p = float(ord)
    size = cx.call("abs", x)
    if p == float("inf"):
        return cx.call("amax", size, axes=axes, keepdims=keepdim)
    if p == float("-inf"):
        return amin(cx, size, axes, keepdim)
    if p == 1:
        return cx.call("sum", size, axes=axes, keepdims=keepdim)
    if p == 2:
        return l2_norm(cx, x, axes, keepdim)
    if p <= 0:
        raise CompileError(f"vector norm of order {ord} is not supported (orders > 0 and inf)")
    total = cx.call("sum", cx.call("pow_scalar", size, exponent=p), axes=axes, keepdims=keepdim)
    total = cx.call("maximum", total, cx.full(1e-30, x.dtype))
    return cx.call("pow_scalar", total, exponent=1.0 / p)
