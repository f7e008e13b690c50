"""ATen converters for image models, composed from IR ops: group norm, adaptive max
pooling, and nearest and bilinear resizing (U-Nets, FPNs, detectors).

Group norm is the IR's fused ``layer_norm`` over each group, then the per-channel affine;
resizing is ``compose.nearest_axis`` and ``compose.linear_axis`` along H and W.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pockengine.frontend.compose import group_normalise, linear_axis, nearest_axis
from pockengine.frontend.torch.converters import Ctx, aten
from pockengine.ir import CompileError, Value

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
    y, mean, rstd = group_normalise(cx, x, group, eps)
    per_channel = (1, c, *([1] * (x.type.rank - 2)))
    if w is not None:
        y = cx.call("mul", y, cx.call("reshape", w, shape=per_channel))
    if b is not None:
        y = cx.call("add", y, cx.call("reshape", b, shape=per_channel))
    return y, mean, rstd


@aten("adaptive_max_pool2d.default")
def _adaptive_max_pool(cx: Ctx, x: Value, output_size: list[int]) -> tuple[Value, None]:
    oh, ow = cx.out_type.shape[-2:]
    h, w = x.shape[-2:]
    if (oh, ow) == (1, 1):
        return cx.call("amax", x, axes=(x.type.rank - 2, x.type.rank - 1), keepdims=True), None
    if h % oh or w % ow:
        raise CompileError(f"adaptive max pooling of {h}x{w} to {oh}x{ow} needs divisible sizes")
    kernel = (h // oh, w // ow)
    y = cx.call(
        "max_pool2d",
        x,
        kernel=kernel,
        stride=kernel,
        padding=(0, 0),
        dilation=(1, 1),
        ceil_mode=False,
    )
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
        ratio = _ratio(x.shape[axis], out[axis], given)
        x = nearest_axis(cx, x, axis, out[axis], ratio, half=exact)
    return x


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
        ratio = _ratio(x.shape[axis], out[axis], given, align)
        x = linear_axis(cx, x, axis, out[axis], ratio, "align" if align else "half")
    return x


@aten("upsample_bilinear2d.vec")
def _bilinear_vec(cx: Ctx, x: Value, output_size: Any, align_corners: bool, scales: Any) -> Value:
    return _bilinear(cx, x, _scales(scales, 2), bool(align_corners))


@aten("upsample_bilinear2d.default")
def _bilinear_default(
    cx: Ctx,
    x: Value,
    output_size: Any,
    align_corners: bool,
    scales_h: Any = None,
    scales_w: Any = None,
) -> Value:
    return _bilinear(cx, x, [_scales(scales_h, 1)[0], _scales(scales_w, 1)[0]], bool(align_corners))
