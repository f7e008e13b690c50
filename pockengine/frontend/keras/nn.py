"""TF converters: bias, convolution and pooling.

Keras keeps images channels-last (NHWC) with HWIO kernels; the IR's ``conv2d`` and pools
are NCHW with OIHW weights. A converter permutes its input to NCHW and the result back, and
reads the kernel through a ``transpose`` (a depthwise kernel through a transpose and a
reshape): the params keep their Keras layout, so gradients and ``state_dict()`` are in it
too. Layout ops cost no FLOPs, so the figures of ``step.report()`` equal those of the same
network written in PyTorch. TF's "SAME" padding puts the odd pixel at the end; the
converters pad explicitly when the two sides differ.
"""

from __future__ import annotations

import math

from pockengine.frontend.keras.converters import Attrs, Ctx, Operand, float_like, tf_op
from pockengine.ir import CompileError, Value

__all__: list[str] = []

_TO_NCHW = (0, 3, 1, 2)
_TO_NHWC = (0, 2, 3, 1)
Pair = tuple[int, int]


def _nchw(cx: Ctx, x: Value, attrs: Attrs) -> tuple[Value, bool]:
    if x.type.rank != 4:
        raise CompileError(f"only 2-D convolution and pooling are supported, got {x.type}")
    channels_last = attrs.get("data_format", "NHWC") == "NHWC"
    return (cx.call("transpose", x, perm=_TO_NCHW) if channels_last else x), channels_last


def _back(cx: Ctx, y: Value, channels_last: bool) -> Value:
    return cx.call("transpose", y, perm=_TO_NHWC) if channels_last else y


def _spatial(values: list[int], channels_last: bool) -> Pair:
    return (values[1], values[2]) if channels_last else (values[2], values[3])


def _pads(
    attrs: Attrs, hw: tuple[int, ...], kernel: Pair, stride: Pair, dilation: Pair
) -> tuple[Pair, Pair]:
    """(begin, end) pads of H and W for padding VALID, SAME or EXPLICIT."""
    mode = attrs.get("padding", "VALID")
    if mode == "VALID":
        return (0, 0), (0, 0)
    if mode == "EXPLICIT":
        flat = list(attrs["explicit_paddings"])
        rows = [flat[i : i + 2] for i in range(0, len(flat), 2)]
        h, w = (rows[1], rows[2]) if attrs.get("data_format", "NHWC") == "NHWC" else rows[2:4]
        return (h[0], w[0]), (h[1], w[1])
    begin, end = [], []
    for size, k, s, d in zip(hw, kernel, stride, dilation, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        begin.append(total // 2)
        end.append(total - total // 2)
    return (begin[0], begin[1]), (end[0], end[1])


def _explicit(cx: Ctx, x: Value, begin: Pair, end: Pair, value: float) -> Value:
    pads = ((0, 0), (0, 0), (begin[0], end[0]), (begin[1], end[1]))
    return cx.call("pad", x, pads=pads, value=value)


def _conv(cx: Ctx, x: Value, w_oihw: Value, attrs: Attrs, groups: int) -> Value:
    x4, channels_last = _nchw(cx, x, attrs)
    stride = _spatial(list(attrs.get("strides", [1, 1, 1, 1])), channels_last)
    dilation = _spatial(list(attrs.get("dilations", [1, 1, 1, 1])), channels_last)
    kernel = (w_oihw.shape[2], w_oihw.shape[3])
    begin, end = _pads(attrs, x4.shape[2:], kernel, stride, dilation)
    if begin != end:
        x4, begin = _explicit(cx, x4, begin, end, 0.0), (0, 0)
    y = cx.call(
        "conv2d", x4, w_oihw, stride=stride, padding=begin, dilation=dilation, groups=groups
    )
    return _back(cx, y, channels_last)


@tf_op("Conv2D")
def _conv2d(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x, w = float_like(cx, ins)
    groups = x.shape[3 if attrs.get("data_format", "NHWC") == "NHWC" else 1] // w.shape[2]
    return _conv(cx, x, cx.call("transpose", w, perm=(3, 2, 0, 1)), attrs, groups)


@tf_op("DepthwiseConv2dNative")
def _depthwise(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """Kernel [kh, kw, C, m]: output channel c * m + j, as a grouped conv with C groups."""
    x, w = float_like(cx, ins)
    kh, kw, c, m = w.shape
    oihw = cx.call("reshape", cx.call("transpose", w, perm=(2, 3, 0, 1)), shape=(c * m, 1, kh, kw))
    return _conv(cx, x, oihw, attrs, c)


@tf_op("BiasAdd")
def _bias_add(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x, b = float_like(cx, ins)
    if attrs.get("data_format", "NHWC") == "NCHW" and x.type.rank > 2:
        b = cx.call("reshape", b, shape=(b.shape[0],) + (1,) * (x.type.rank - 2))
    return cx.call("add", x, b)


def _pool_geometry(x4: Value, attrs: Attrs, channels_last: bool) -> tuple[Pair, Pair, Pair, Pair]:
    kernel = _spatial(list(attrs["ksize"]), channels_last)
    stride = _spatial(list(attrs["strides"]), channels_last)
    begin, end = _pads(attrs, x4.shape[2:], kernel, stride, (1, 1))
    return kernel, stride, begin, end


@tf_op("MaxPool")
def _max_pool(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x4, channels_last = _nchw(cx, cx.value(ins[0]), attrs)
    kernel, stride, begin, end = _pool_geometry(x4, attrs, channels_last)
    if begin != end or any(p > k // 2 for p, k in zip(begin, kernel, strict=True)):
        x4, begin = _explicit(cx, x4, begin, end, -math.inf), (0, 0)
    y = cx.call(
        "max_pool2d",
        x4,
        kernel=kernel,
        stride=stride,
        padding=begin,
        dilation=(1, 1),
        ceil_mode=False,
    )
    return _back(cx, y, channels_last)


@tf_op("AvgPool")
def _avg_pool(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """TF's SAME average pooling divides by the pixels inside the image."""
    x4, channels_last = _nchw(cx, cx.value(ins[0]), attrs)
    kernel, stride, begin, end = _pool_geometry(x4, attrs, channels_last)
    if begin != end:
        raise CompileError("AvgPool with SAME padding that differs per side is not supported")
    y = cx.call(
        "avg_pool2d",
        x4,
        kernel=kernel,
        stride=stride,
        padding=begin,
        ceil_mode=False,
        count_include_pad=False,
        divisor_override=None,
    )
    return _back(cx, y, channels_last)
