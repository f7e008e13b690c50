"""ONNX converters for what image models and exporters add beyond plain convolutions:
``ConvTranspose``, ``Resize``, ``InstanceNormalization`` and ``GroupNormalization`` (how
PyTorch's group norm exports), the ELU family (``Elu``, ``Selu``, ``Celu``), ``Softplus``,
``Softsign``, and the reductions ``ReduceMin``, ``ReduceL1``, ``ReduceL2``,
``ReduceSumSquare``, ``ArgMax`` and ``ArgMin``, and ``TopK`` (the IR's ``topk``). Each of
the others is composed from IR ops (``compose``, shared with the PyTorch and Keras
frontends), so every backend runs it and autodiff needs nothing new.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.frontend import compose
from pockengine.frontend.onnx.converters import (
    Ctx,
    Operand,
    const_ints,
    ints_attr,
    norm_axis,
    onnx_op,
)
from pockengine.frontend.onnx.math import reducer
from pockengine.ir import CompileError, Value

__all__: list[str] = []


def _text(attrs: dict[str, Any], key: str, default: str) -> str:
    value = attrs.get(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


# -- activations ---------------------------------------------------------------------------


@onnx_op("Elu")
def _elu(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    return compose.elu(cx, cx.value(ins[0]), float(attrs.get("alpha", 1.0)))


@onnx_op("Selu")
def _selu(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    alpha = float(attrs.get("alpha", 1.67326319217681884765625))
    gamma = float(attrs.get("gamma", 1.05070102214813232421875))
    return compose.elu(cx, cx.value(ins[0]), alpha, gamma)


@onnx_op("Celu")
def _celu(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    alpha = float(attrs.get("alpha", 1.0))
    return compose.elu(cx, cx.value(ins[0]), alpha, 1.0, 1.0 / alpha)


@onnx_op("Softplus")
def _softplus(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    return compose.softplus(cx, cx.value(ins[0]))


@onnx_op("Softsign")
def _softsign(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    return compose.softsign(cx, cx.value(ins[0]))


@onnx_op("Einsum")
def _einsum(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    operands = [cx.value(x) for x in ins]
    return compose.einsum(cx, _text(attrs, "equation", ""), operands)


# -- normalisation -------------------------------------------------------------------------


def _per_channel(cx: Ctx, y: Value, scale: Value, bias: Value) -> Value:
    shape = (1, y.shape[1], *([1] * (y.type.rank - 2)))
    y = cx.call("mul", y, cx.call("reshape", scale, shape=shape))
    return cx.call("add", y, cx.call("reshape", bias, shape=shape))


@onnx_op("InstanceNormalization")
def _instance_norm(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    y = compose.group_normalise(cx, x, x.shape[1], float(attrs.get("epsilon", 1e-5)))[0]
    return _per_channel(cx, y, cx.like(ins[1], x), cx.like(ins[2], x))


@onnx_op("GroupNormalization")
def _group_norm(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    """Scale and bias per channel (opset 21) or per group (opset 18: each repeated over
    its group's channels)."""
    x = cx.value(ins[0])
    groups, c = int(attrs["num_groups"]), x.shape[1]
    y = compose.group_normalise(cx, x, groups, float(attrs.get("epsilon", 1e-5)))[0]
    scale, bias = cx.like(ins[1], x), cx.like(ins[2], x)
    if scale.shape[0] != c:
        scale = compose.repeat_axis(cx, scale, 0, c // groups)
        bias = compose.repeat_axis(cx, bias, 0, c // groups)
    return _per_channel(cx, y, scale, bias)


# -- transposed convolution ----------------------------------------------------------------


def _transpose_pads(
    attrs: dict[str, Any], total: list[int], explicit: list[int]
) -> tuple[list[int], list[int]]:
    """(begin, end) pads of each spatial axis: explicit, or split from the total as the
    ONNX spec does for ``output_shape`` and ``auto_pad``."""
    mode = _text(attrs, "auto_pad", "NOTSET")
    if "output_shape" not in attrs and mode in ("NOTSET", "", "VALID"):
        nd = len(total)
        return (explicit[:nd], explicit[nd:]) if mode != "VALID" else ([0] * nd, [0] * nd)
    begin = [t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total]
    return begin, [t - b for t, b in zip(total, begin, strict=True)]


@onnx_op("ConvTranspose")
def _conv_transpose(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    w = cx.like(ins[1], x)
    flat = x.type.rank == 3
    if flat:  # 1-D: a height of one
        x = cx.call("reshape", x, shape=(x.shape[0], x.shape[1], 1, x.shape[2]))
        w = cx.call("reshape", w, shape=(w.shape[0], w.shape[1], 1, w.shape[2]))
    if x.type.rank != 4:
        raise CompileError(f"only 1-D and 2-D ConvTranspose is supported, got {x.type}")
    nd = 1 if flat else 2
    kernel = [(w.shape[2 + i] if not flat else w.shape[3]) for i in range(nd)]
    strides = ints_attr(attrs, "strides", [1] * nd)
    dilations = ints_attr(attrs, "dilations", [1] * nd)
    extra = ints_attr(attrs, "output_padding", [0] * nd)
    sizes = list(x.shape[4 - nd :])
    geometry = zip(sizes, strides, extra, kernel, dilations, strict=True)
    full = [s * (i - 1) + e + (k - 1) * d + 1 for i, s, e, k, d in geometry]
    same = _text(attrs, "auto_pad", "NOTSET").startswith("SAME")
    default = [i * s for i, s in zip(sizes, strides, strict=True)] if same else full
    wanted = ints_attr(attrs, "output_shape", default)[-nd:]
    if any(o > f for o, f in zip(wanted, full, strict=True)):
        raise CompileError(
            f"ConvTranspose output shape {wanted} is larger than its input {sizes} can make "
            f"({full}: by stride, kernel, output_padding)"
        )
    begin, end = _transpose_pads(
        attrs,
        [f - o for f, o in zip(full, wanted, strict=True)],
        ints_attr(attrs, "pads", [0] * 2 * nd),
    )
    out = [f - b - e for f, b, e in zip(full, begin, end, strict=True)]
    groups = int(attrs.get("group", 1))
    shape = (x.shape[0], w.shape[1] * groups, *([1] if flat else []), *out)

    def pair(v: list[int], fill: int) -> tuple[int, int]:
        return (fill, v[0]) if flat else (v[0], v[1])

    pads = (pair(begin, 0), pair(end, 0))
    y = compose.transposed_conv2d(
        cx, x, w, shape, pair(strides, 1), pads, pair(dilations, 1), groups
    )
    if len(ins) > 2 and ins[2] is not None:
        y = cx.call("add", y, cx.call("reshape", cx.like(ins[2], x), shape=(1, shape[1], 1, 1)))
    return cx.call("reshape", y, shape=(shape[0], shape[1], shape[3])) if flat else y


# -- resizing ------------------------------------------------------------------------------


def _resize_sizes(ins: list[Operand], x: Value) -> tuple[list[int], list[float | None]]:
    """The output sizes and, where given, the scales (ONNX: sizes win; else floor of
    input times scale)."""
    more = [*ins[1:], None, None, None]
    scales_in, sizes_in = more[1], more[2]
    if sizes_in is not None and np.asarray(sizes_in).size:
        sizes = const_ints(sizes_in, "Resize sizes")
        return sizes, [None] * len(sizes)
    if scales_in is None or isinstance(scales_in, Value):
        raise CompileError("Resize needs constant scales or sizes")
    scales = [float(s) for s in np.asarray(scales_in).reshape(-1)]
    return [int(np.floor(n * s)) for n, s in zip(x.shape, scales, strict=True)], list(scales)


def _source(mode: str, nearest: str, n: int, size: int, scale: float) -> np.ndarray[Any, Any]:
    """The nearest source index of each output position, by the ONNX spec, in float32."""
    i = np.arange(size, dtype=np.float32)
    r = np.float32(1.0 / scale)
    if mode == "asymmetric":
        pos = i * r
    elif mode in ("half_pixel", "pytorch_half_pixel"):
        pos = (i + np.float32(0.5)) * r - np.float32(0.5)
        if mode == "pytorch_half_pixel" and size == 1:
            pos = np.zeros(1, np.float32)
    elif mode == "align_corners":
        pos = i * np.float32((n - 1) / (size - 1)) if size > 1 else np.zeros(1, np.float32)
    else:
        raise CompileError(f"Resize coordinate_transformation_mode {mode!r} is not supported")
    rounded = {
        "floor": np.floor(pos),
        "ceil": np.ceil(pos),
        "round_prefer_floor": np.ceil(pos - np.float32(0.5)),
        "round_prefer_ceil": np.floor(pos + np.float32(0.5)),
    }.get(nearest)
    if rounded is None:
        raise CompileError(f"Resize nearest_mode {nearest!r} is not supported")
    src: np.ndarray[Any, Any] = np.clip(rounded.astype(np.int64), 0, n - 1)
    return src


@onnx_op("Resize", "Upsample")
def _resize(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    if int(attrs.get("antialias", 0)):
        raise CompileError("Resize with antialias is not supported")
    mode = _text(attrs, "mode", "nearest")
    coords = _text(
        attrs, "coordinate_transformation_mode", "half_pixel" if cx.opset >= 11 else "asymmetric"
    )
    nearest = _text(attrs, "nearest_mode", "round_prefer_floor" if cx.opset >= 11 else "floor")
    if len(ins) == 2 and cx.opset < 11:  # Upsample / Resize-10: (X, scales)
        ins = [ins[0], None, ins[1]]
    sizes, scales = _resize_sizes(ins, x)
    for axis, (n, size, given) in enumerate(zip(x.shape, sizes, scales, strict=True)):
        if size == n and given in (None, 1.0):
            continue
        scale = given if given else size / n
        if mode == "nearest":
            src = _source(coords, nearest, n, size, scale)
            x = _take(cx, x, axis, src, 1.0 / scale)
        elif mode == "linear":
            kind = {
                "half_pixel": "half",
                "pytorch_half_pixel": "half",
                "align_corners": "align",
                "asymmetric": "asymmetric",
            }.get(coords)
            if kind is None:
                raise CompileError(f"linear Resize with {coords!r} coordinates is not supported")
            ratio = (n - 1) / (size - 1) if kind == "align" and size > 1 else 1.0 / scale
            x = compose.linear_axis(cx, x, axis, size, ratio, kind)
        else:
            raise CompileError(f"Resize mode {mode!r} is not supported (nearest, linear)")
    return x


def _take(cx: Ctx, x: Value, axis: int, src: np.ndarray[Any, Any], ratio: float) -> Value:
    """``x`` at the source positions ``src`` along ``axis``: the shared nearest resizing
    where ``src`` is its pattern (a repeat or a stride needs no index), else an index."""
    n, size = x.shape[axis], src.size
    for half in (False, True):
        pos = np.arange(size, dtype=np.float32) + np.float32(0.5 if half else 0.0)
        same = np.minimum(np.floor(pos * np.float32(ratio)).astype(np.int64), n - 1)
        if np.array_equal(same, src):
            return compose.nearest_axis(cx, x, axis, size, ratio, half)
    return cx.call("index", x, cx.value(src), axes=(axis,))


# -- reductions ----------------------------------------------------------------------------


def _sum_abs(cx: Ctx, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
    return cx.call("sum", cx.call("abs", x), axes=axes, keepdims=keep)


def _sum_squares(cx: Ctx, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
    return cx.call("sum", cx.call("mul", x, x), axes=axes, keepdims=keep)


onnx_op("ReduceMin")(reducer(compose.amin))
onnx_op("ReduceL1")(reducer(_sum_abs))
onnx_op("ReduceL2")(reducer(compose.l2_norm))
onnx_op("ReduceSumSquare")(reducer(_sum_squares))


def _arg(lowest: bool) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        """The first (``select_last_index``: last) position of the extreme, int64."""
        x = cx.value(ins[0])
        axis = norm_axis(int(attrs.get("axis", 0)), x.type.rank)
        keep, last = bool(attrs.get("keepdims", 1)), bool(attrs.get("select_last_index", 0))
        return compose.arg_extreme(cx, x, axis, keep, lowest, last)

    return convert


onnx_op("ArgMax")(_arg(lowest=False))
onnx_op("ArgMin")(_arg(lowest=True))


@onnx_op("TopK")
def _topk(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, Value]:
    """The IR's ``topk`` (always sorted: an unsorted TopK may return any order); K must
    be a constant."""
    x = cx.value(ins[0])
    (k,) = const_ints(ins[1], "TopK's K")
    axis = norm_axis(int(attrs.get("axis", -1)), x.type.rank)
    largest = bool(attrs.get("largest", 1))
    values, indices = cx.call_multi("topk", x, k=k, axis=axis, largest=largest)
    return values, indices
