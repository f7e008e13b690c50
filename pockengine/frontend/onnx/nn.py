"""ONNX converters: convolution, pooling, normalisation, dropout.

BatchNormalization with ``training_mode=1`` (the TorchScript exporter with
``training=TrainingMode.TRAINING``) normalises with the batch statistics and updates the
running statistics as the ONNX operator defines it: ``running = running * momentum +
batch * (1 - momentum)``, the batch variance being the biased one (PyTorch itself keeps the
unbiased one). Inference-mode BatchNormalization (what the dynamo exporter writes for
every BatchNorm, and any BatchNorm of a module a scheme freezes with ``frozen_bn="eval"``)
lowers to elementwise ops on the running statistics.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pockengine.frontend.lowering import batch_norm_eval
from pockengine.frontend.onnx.converters import Ctx, Operand, ints_attr, norm_axis, onnx_op
from pockengine.ir import CompileError, Role, Value

__all__: list[str] = []

Pads = tuple[tuple[int, int], tuple[int, int]]


def _auto_pads(
    attrs: dict[str, Any],
    hw: tuple[int, ...],
    kernel: list[int],
    strides: list[int],
    dilations: list[int],
) -> list[int]:
    """ONNX pads [h_begin, w_begin, h_end, w_end], auto_pad resolved."""
    mode = attrs.get("auto_pad", "NOTSET")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode in ("NOTSET", ""):
        return ints_attr(attrs, "pads", [0] * (2 * len(hw)))
    if mode == "VALID":
        return [0] * (2 * len(hw))
    begins, ends = [], []
    for size, k, s, d in zip(hw, kernel, strides, dilations, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small = total // 2
        begins.append(small if mode == "SAME_UPPER" else total - small)
        ends.append(total - begins[-1])
    return begins + ends


def _as_2d(cx: Ctx, x: Value) -> tuple[Value, bool]:
    """A 1-D (N, C, L) input as (N, C, 1, L)."""
    if x.type.rank == 3:
        return cx.call("reshape", x, shape=(x.shape[0], x.shape[1], 1, x.shape[2])), True
    if x.type.rank != 4:
        raise CompileError(f"only 1-D and 2-D convolution and pooling are supported, got {x.type}")
    return x, False


def _pair(values: list[int], flat: bool, fill: int) -> tuple[int, int]:
    return (fill, values[0]) if flat else (values[0], values[1])


def _geometry(
    cx: Ctx, x: Value, attrs: dict[str, Any], kernel: list[int]
) -> tuple[Value, bool, dict[str, tuple[int, int]], Pads]:
    """The input as NCHW, whether it was 1-D, the stride/dilation pairs and the pads."""
    nd = len(kernel)
    strides = ints_attr(attrs, "strides", [1] * nd)
    dilations = ints_attr(attrs, "dilations", [1] * nd)
    pads = _auto_pads(attrs, x.shape[2:], kernel, strides, dilations)
    x4, flat = _as_2d(cx, x)
    begin, end = _pair(pads[:nd], flat, 0), _pair(pads[nd:], flat, 0)
    geo = {
        "stride": _pair(strides, flat, 1),
        "dilation": _pair(dilations, flat, 1),
        "kernel": _pair(kernel, flat, 1),
    }
    return x4, flat, geo, (begin, end)


def _restore(cx: Ctx, y: Value, flat: bool) -> Value:
    return cx.call("reshape", y, shape=(y.shape[0], y.shape[1], y.shape[3])) if flat else y


def _explicit_pad(cx: Ctx, x: Value, pads: Pads, value: float) -> Value:
    (hb, wb), (he, we) = pads
    return cx.call("pad", x, pads=((0, 0), (0, 0), (hb, he), (wb, we)), value=value)


@onnx_op("Conv")
def _conv(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    w = cx.like(ins[1], x)
    kernel = ints_attr(attrs, "kernel_shape", list(w.shape[2:]))
    x4, flat, geo, (begin, end) = _geometry(cx, x, attrs, kernel)
    if flat:
        w = cx.call("reshape", w, shape=(w.shape[0], w.shape[1], 1, w.shape[2]))
    padding = begin
    if begin != end:  # asymmetric: pad explicitly with zeros
        x4, padding = _explicit_pad(cx, x4, (begin, end), 0.0), (0, 0)
    inputs = [x4, w] + ([cx.like(ins[2], x)] if len(ins) > 2 and ins[2] is not None else [])
    y = cx.call(
        "conv2d",
        *inputs,
        stride=geo["stride"],
        padding=padding,
        dilation=geo["dilation"],
        groups=int(attrs.get("group", 1)),
    )
    return _restore(cx, y, flat)


@onnx_op("MaxPool")
def _max_pool(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, None]:
    x = cx.value(ins[0])
    x4, flat, geo, (begin, end) = _geometry(cx, x, attrs, ints_attr(attrs, "kernel_shape"))
    padding = begin
    if begin != end or any(p > k // 2 for p, k in zip(begin, geo["kernel"], strict=True)):
        x4, padding = _explicit_pad(cx, x4, (begin, end), -math.inf), (0, 0)
    y = cx.call(
        "max_pool2d",
        x4,
        kernel=geo["kernel"],
        stride=geo["stride"],
        padding=padding,
        dilation=geo["dilation"],
        ceil_mode=bool(attrs.get("ceil_mode", 0)),
    )
    return _restore(cx, y, flat), None  # the Indices output is not supported


@onnx_op("AveragePool")
def _avg_pool(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    x4, flat, geo, (begin, end) = _geometry(cx, x, attrs, ints_attr(attrs, "kernel_shape"))
    if begin != end or geo["dilation"] != (1, 1):
        raise CompileError("AveragePool with asymmetric pads or dilations is not supported")
    y = cx.call(
        "avg_pool2d",
        x4,
        kernel=geo["kernel"],
        stride=geo["stride"],
        padding=begin,
        ceil_mode=bool(attrs.get("ceil_mode", 0)),
        count_include_pad=bool(attrs.get("count_include_pad", 0)),
        divisor_override=None,
    )
    return _restore(cx, y, flat)


@onnx_op("GlobalAveragePool")
def _global_avg(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    return cx.call("mean", x, axes=tuple(range(2, x.type.rank)), keepdims=True)


@onnx_op("GlobalMaxPool")
def _global_max(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    return cx.call("amax", x, axes=tuple(range(2, x.type.rank)), keepdims=True)


# -- normalisation ---------------------------------------------------------------------------


def _bn_eval(cx: Ctx, x: Value, w: Value, b: Value, mean: Value, var: Value, eps: float) -> Value:
    return batch_norm_eval(cx.b, cx.source, x, w, b, mean, var, eps)


@onnx_op("BatchNormalization")
def _batch_norm(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, ...]:
    x = cx.value(ins[0])
    w, b, mean, var = (cx.like(v, x) for v in ins[1:5])
    eps = float(attrs.get("epsilon", 1e-5))
    module = cx.module_of.get(w.name, "")
    training = bool(attrs.get("training_mode", 0)) and module not in cx.eval_modules
    if not training:
        return (_bn_eval(cx, x, w, b, mean, var, eps), mean, var)
    y, batch_mean, batch_var = cx.call_multi("batch_norm", x, w, b, eps=eps)
    momentum = float(attrs.get("momentum", 0.9))
    keep, take = cx.full(momentum, x.dtype), cx.full(1.0 - momentum, x.dtype)
    new = []
    for running, batch in ((mean, batch_mean), (var, batch_var)):
        blended = cx.call("add", cx.call("mul", running, keep), cx.call("mul", batch, take))
        if running.role is Role.BUFFER:
            cx.effect("assign", running, blended)
        new.append(blended)
    return (y, *new)


@onnx_op("LayerNormalization")
def _layer_norm(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, ...]:
    x = cx.value(ins[0])
    axis = norm_axis(int(attrs.get("axis", -1)), x.type.rank)
    normalized = x.shape[axis:]
    w = cx.like(ins[1], x)
    b = cx.like(ins[2], x) if len(ins) > 2 and ins[2] is not None else cx.full(0.0, x.dtype)
    w, b = (
        v if v.shape == normalized else cx.call("broadcast_to", v, shape=normalized) for v in (w, b)
    )
    eps = float(attrs.get("epsilon", 1e-5))
    return cx.call_multi("layer_norm", x, w, b, eps=eps, ndim=x.type.rank - axis)


@onnx_op("Dropout")
def _dropout(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, Value | None]:
    """Before opset 12 Dropout is an inference op (identity); from 12 on it trains when its
    training_mode input is a constant true."""
    x = cx.value(ins[0])
    ratio_in, mode_in = [*ins[1:], None, None][:2]
    if isinstance(ratio_in, Value) or isinstance(mode_in, Value):
        raise CompileError("Dropout's ratio and training_mode must be constants")
    ratio = 0.5 if ratio_in is None else float(np.asarray(ratio_in).reshape(-1)[0])
    training = cx.opset >= 12 and mode_in is not None and bool(np.asarray(mode_in).reshape(-1)[0])
    if not training or ratio == 0.0:
        return x, None
    return cx.dropout(x, ratio)
