"""ATen converters for image models, composed from IR ops: group norm, adaptive max
pooling, and nearest and bilinear resizing (U-Nets, FPNs, detectors).

Group norm is the IR's fused ``layer_norm`` over each group, then the per-channel affine.
Resizing reads source rows and columns by index (``index``, whose gradient scatters
back); a whole-number scale repeats or strides instead, which needs no index at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.frontend.torch_ops import Ctx, aten
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


@aten("native_group_norm.default")
def _group_norm(
    cx: Ctx,
    x: Value,
    w: Value | None,
    b: Value | None,
    n: int,
    c: int,
    hw: int,
    group: int,
    eps: float,
) -> tuple[Value, Value, Value]:
    """(y, mean, rstd): each group of C / G channels normalised over its channels and
    positions, then y * w + b per channel; the statistics are [N, G], as ATen's."""
    size = (c // group) * hw
    grouped = cx.call("reshape", x, shape=(n, group, size))
    ones, zeros = cx.full(1.0, x.dtype, (size,)), cx.full(0.0, x.dtype, (size,))
    y, mean, rstd = cx.call_multi("layer_norm", grouped, ones, zeros, eps=float(eps), ndim=1)
    y = cx.call("reshape", y, shape=x.shape)
    per_channel = (1, c, *([1] * (x.type.rank - 2)))
    if w is not None:
        y = cx.call("mul", y, cx.call("reshape", w, shape=per_channel))
    if b is not None:
        y = cx.call("add", y, cx.call("reshape", b, shape=per_channel))
    stats = (n, group)
    return y, cx.call("reshape", mean, shape=stats), cx.call("reshape", rstd, shape=stats)


@aten("adaptive_max_pool2d.default")
def _adaptive_max_pool(cx: Ctx, x: Value, output_size: list[int]) -> tuple[Value, None]:
    oh, ow = cx.out_type.shape[-2:]
    h, w = x.shape[-2:]
    if (oh, ow) == (1, 1):
        return cx.call("amax", x, axes=(x.type.rank - 2, x.type.rank - 1), keepdims=True), None
    if h % oh or w % ow:
        raise CompileError(f"adaptive max pooling of {h}x{w} to {oh}x{ow} needs divisible sizes")
    kernel = (h // oh, w // ow)
    y = cx.call("max_pool2d", x, kernel=kernel, stride=kernel, padding=(0, 0), dilation=(1, 1),
                ceil_mode=False)  # fmt: skip
    return y, None  # the indices only serve ATen's own backward


def _scales(given: Any, count: int) -> list[float | None]:
    if given is None:
        return [None] * count
    seq = list(given) if isinstance(given, list | tuple) else [given] * count
    return [None if s is None else float(s) for s in seq]


def _ratio(size_in: int, size_out: int, given: float | None, align: bool = False) -> float:
    """Source pixels per output pixel, as ATen's ``area_pixel_compute_scale``."""
    if align:
        return (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    return 1.0 / given if given else size_in / size_out


def _nearest(cx: Ctx, x: Value, scales: Sequence[float | None], exact: bool) -> Value:
    out = cx.out_type.shape
    for axis, given in zip((2, 3), scales, strict=True):
        x = _nearest_axis(cx, x, axis, out[axis], _ratio(x.shape[axis], out[axis], given), exact)
    return x


def _nearest_axis(cx: Ctx, x: Value, axis: int, size: int, ratio: float, exact: bool) -> Value:
    """ATen's source index floor((i [+ 0.5]) * ratio), clipped, in float32 as ATen's."""
    n = x.shape[axis]
    step = np.float32(ratio)
    pos = np.arange(size, dtype=np.float32) + (np.float32(0.5) if exact else np.float32(0))
    src = np.minimum(np.floor(pos * step).astype(np.int64), n - 1)
    if np.array_equal(src, np.arange(n)):
        return x
    if size % n == 0 and np.array_equal(src, np.arange(size) // (size // n)):
        return _repeat(cx, x, axis, size // n)
    k = n // size if size else 0
    if k and np.array_equal(src, np.arange(size) * k + src[0]):
        stop = int(src[-1]) + 1
        return cx.call("slice", x, axis=axis, start=int(src[0]), stop=stop, step=k)
    return cx.call("index", x, _source_index(cx, size, step, exact, n), axes=(axis,))


def _source_index(cx: Ctx, size: int, step: np.float32, exact: bool, n: int) -> Value:
    pos = cx.call("arange", start=0, stop=size, step=1, dtype="f32")
    if exact:
        pos = cx.call("add", pos, cx.full(0.5, DType.F32))
    src = cx.cast(cx.call("mul", pos, cx.full(float(step), DType.F32)), DType.I64)
    return cx.call("minimum", src, cx.full(n - 1, DType.I64))


def _repeat(cx: Ctx, x: Value, axis: int, k: int) -> Value:
    """Every element of ``axis`` repeated ``k`` times in place (an integer upscale)."""
    shape = x.shape
    wide = (*shape[: axis + 1], k, *shape[axis + 1 :])
    y = cx.call("reshape", x, shape=(*shape[: axis + 1], 1, *shape[axis + 1 :]))
    y = cx.call("broadcast_to", y, shape=wide)
    return cx.call("reshape", y, shape=(*shape[:axis], shape[axis] * k, *shape[axis + 1 :]))


@aten("upsample_nearest2d.vec", "_upsample_nearest_exact2d.vec")
def _nearest_vec(cx: Ctx, x: Value, output_size: Any, scale_factors: Any) -> Value:
    exact = "exact" in str(getattr(cx.node, "target", ""))
    return _nearest(cx, x, _scales(scale_factors, 2), exact)


@aten("upsample_nearest2d.default", "_upsample_nearest_exact2d.default")
def _nearest_default(
    cx: Ctx, x: Value, output_size: Any, scales_h: Any = None, scales_w: Any = None
) -> Value:
    exact = "exact" in str(getattr(cx.node, "target", ""))
    return _nearest(cx, x, [_scales(scales_h, 1)[0], _scales(scales_w, 1)[0]], exact)


def _bilinear(cx: Ctx, x: Value, scales: Sequence[float | None], align: bool) -> Value:
    out = cx.out_type.shape
    for axis, given in zip((2, 3), scales, strict=True):
        n, size = x.shape[axis], out[axis]
        if n != size or given not in (None, 1.0):
            x = _linear_axis(cx, x, axis, size, _ratio(n, size, given, align), align)
    return x


def _linear_axis(cx: Ctx, x: Value, axis: int, size: int, ratio: float, align: bool) -> Value:
    """Linear interpolation along ``axis``: x[i0] * (1 - t) + x[i1] * t, where the source
    position is i * ratio (align_corners) or (i + 0.5) * ratio - 0.5 clipped at 0."""
    n = x.shape[axis]
    pos = cx.call("arange", start=0, stop=size, step=1, dtype="f32")
    if align:
        src = cx.call("mul", pos, cx.full(ratio, DType.F32))
    else:
        src = cx.call("add", pos, cx.full(0.5, DType.F32))
        src = cx.call(
            "sub", cx.call("mul", src, cx.full(ratio, DType.F32)), cx.full(0.5, DType.F32)
        )
        src = cx.call("maximum", src, cx.full(0.0, DType.F32))
    lo = cx.call("minimum", cx.cast(src, DType.I64), cx.full(n - 1, DType.I64))
    hi = cx.call("minimum", cx.call("add", lo, cx.full(1, DType.I64)), cx.full(n - 1, DType.I64))
    frac = cx.call("sub", src, cx.cast(lo, DType.F32))
    shape = tuple(size if i == axis else 1 for i in range(x.type.rank))
    frac = cx.cast(cx.call("reshape", frac, shape=shape), x.dtype)
    low = cx.call("index", x, lo, axes=(axis,))
    high = cx.call("index", x, hi, axes=(axis,))
    return cx.call("add", low, cx.call("mul", cx.call("sub", high, low), frac))


@aten("upsample_bilinear2d.vec")
def _bilinear_vec(cx: Ctx, x: Value, output_size: Any, align_corners: bool, scales: Any) -> Value:
    return _bilinear(cx, x, _scales(scales, 2), bool(align_corners))


@aten("upsample_bilinear2d.default")
def _bilinear_default(
    cx: Ctx, x: Value, output_size: Any, align_corners: bool, scales_h: Any = None,
    scales_w: Any = None,
) -> Value:  # fmt: skip
    return _bilinear(cx, x, [_scales(scales_h, 1)[0], _scales(scales_w, 1)[0]], bool(align_corners))
