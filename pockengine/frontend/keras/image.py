"""TF converters for image and activation layers Keras models use beyond plain
convolutions: ``Conv2DTranspose`` (``Conv2DBackpropInput``), ``UpSampling2D`` and
``Resizing`` (``ResizeNearestNeighbor``, ``ResizeBilinear``, and ``Tile`` for Keras'
own repeat), the ELU family (``Elu``, ``Selu``), ``Softplus``, ``Softsign``, and what a
Keras RNN built with ``unroll=True`` traces to (``Unpack``, ``Split``, ``SplitV``,
``ReverseV2``). Each is the ``compose`` helper the PyTorch frontend uses too (images on
NHWC axes 1 and 2).
"""

from __future__ import annotations

from pockengine.frontend import compose
from pockengine.frontend.keras.converters import (
    Attrs,
    Ctx,
    Operand,
    const_ints,
    float_like,
    norm_axis,
    tf_op,
)
from pockengine.frontend.keras.nn import _pads, _spatial
from pockengine.ir import CompileError, Value

__all__: list[str] = []

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805


@tf_op("Elu")
def _elu(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return compose.elu(cx, cx.value(ins[0]))


@tf_op("Selu")
def _selu(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return compose.elu(cx, cx.value(ins[0]), _SELU_ALPHA, _SELU_SCALE)


@tf_op("Softplus")
def _softplus(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return compose.softplus(cx, cx.value(ins[0]))


@tf_op("Softsign")
def _softsign(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return compose.softsign(cx, cx.value(ins[0]))


@tf_op("Tile")
def _tile(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    for axis, k in enumerate(const_ints(ins[1], "Tile multiples")):
        if k != 1:
            x = compose.tile_axis(cx, x, axis, k)
    return x


def _resize_size(ins: list[Operand], x: Value) -> tuple[int, int]:
    if x.type.rank != 4:
        raise CompileError(f"resizing takes NHWC images, got {x.type}")
    h, w = const_ints(ins[1], "resize size")
    return h, w


def _ratio(n: int, size: int, align: bool) -> float:
    if align:
        return (n - 1) / (size - 1) if size > 1 else 0.0
    return n / size


@tf_op("ResizeNearestNeighbor")
def _resize_nearest(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    if attrs.get("align_corners", False):
        raise CompileError("nearest resizing with align_corners=True is not supported")
    half = bool(attrs.get("half_pixel_centers", False))
    for axis, size in zip((1, 2), _resize_size(ins, x), strict=True):
        x = compose.nearest_axis(cx, x, axis, size, _ratio(x.shape[axis], size, False), half)
    return x


@tf_op("ResizeBilinear")
def _resize_bilinear(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    align = bool(attrs.get("align_corners", False))
    mode = "align" if align else "half" if attrs.get("half_pixel_centers", False) else "asymmetric"
    for axis, size in zip((1, 2), _resize_size(ins, x), strict=True):
        ratio = _ratio(x.shape[axis], size, align)
        x = compose.linear_axis(cx, x, axis, size, ratio, mode)
    return x


@tf_op("Conv2DBackpropInput")
def _conv_transpose(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """Keras' Conv2DTranspose: the input gradient of the convolution whose input has
    ``input_sizes`` and whose kernel (HWIO) is the filter."""
    sizes = const_ints(ins[0], "Conv2DBackpropInput input_sizes")
    w, dy = float_like(cx, ins[1:])
    channels_last = attrs.get("data_format", "NHWC") == "NHWC"
    if channels_last:
        dy = cx.call("transpose", dy, perm=(0, 3, 1, 2))
    order = (0, 3, 1, 2) if channels_last else (0, 1, 2, 3)
    out = tuple(sizes[i] for i in order)
    stride = _spatial(list(attrs.get("strides", [1, 1, 1, 1])), channels_last)
    dilation = _spatial(list(attrs.get("dilations", [1, 1, 1, 1])), channels_last)
    oihw = cx.call("transpose", w, perm=(3, 2, 0, 1))
    kernel = (oihw.shape[2], oihw.shape[3])
    pads = _pads(attrs, out[2:], kernel, stride, dilation)
    groups = out[1] // oihw.shape[1]
    y = compose.transposed_conv2d(cx, dy, oihw, out, stride, pads, dilation, groups)
    return cx.call("transpose", y, perm=(0, 2, 3, 1)) if channels_last else y


# -- what an unrolled Keras RNN traces to ------------------------------------------


@tf_op("Unpack")
def _unpack(cx: Ctx, ins: list[Operand], attrs: Attrs) -> tuple[Value, ...]:
    """The slices of one axis, that axis dropped (``tf.unstack``: an unrolled RNN's steps)."""
    x = cx.value(ins[0])
    axis = norm_axis(int(attrs.get("axis", 0)), x.type.rank)
    shape = (*x.shape[:axis], *x.shape[axis + 1 :])
    parts = compose.split_axis(cx, x, axis, [1] * x.shape[axis])
    return tuple(cx.call("reshape", p, shape=shape) for p in parts)


@tf_op("Split")
def _split(cx: Ctx, ins: list[Operand], attrs: Attrs) -> tuple[Value, ...]:
    x = cx.value(ins[1])
    axis = norm_axis(const_ints(ins[0], "Split axis")[0], x.type.rank)
    n = int(attrs.get("num_split", 1))
    if x.shape[axis] % n:
        raise CompileError(f"Split of {x.type} axis {axis} into {n} unequal parts")
    return tuple(compose.split_axis(cx, x, axis, [x.shape[axis] // n] * n))


@tf_op("SplitV")
def _split_v(cx: Ctx, ins: list[Operand], attrs: Attrs) -> tuple[Value, ...]:
    x = cx.value(ins[0])
    sizes = const_ints(ins[1], "SplitV sizes")
    axis = norm_axis(const_ints(ins[2], "SplitV axis")[0], x.type.rank)
    if -1 in sizes:
        sizes[sizes.index(-1)] = x.shape[axis] - (sum(sizes) + 1)
    return tuple(compose.split_axis(cx, x, axis, sizes))


@tf_op("ReverseV2")
def _reverse(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    for axis in const_ints(ins[1], "ReverseV2 axes"):
        x = compose.flip_axis(cx, x, norm_axis(axis, x.type.rank))
    return x
