"""ONNX kernels of convolution, pooling, normalisation and the dropout mask.

- conv2d is Conv; its input gradient is ConvTranspose with the output padding that restores
  the input's size; its weight gradient is one grouped Conv in which the batch plays the
  channels: x as [C/g, g*N, H, W] convolved with gy as [O, N, Ho, Wo] (strides and
  dilations swapped), cropped to the kernel.
- Average pooling is a sum (a depthwise Conv with a ones kernel over explicitly padded
  input) divided by the reference kernel's divisor map, a constant; its gradient is the
  ConvTranspose of the same ones kernel, cropped.
- max_pool2d_grad scatters gy to the Indices output of MaxPool (the first maximum of each
  window, as the reference kernel).
- Batch and layer norm follow the reference formulas with Reduce* ops.
- random_mask reproduces the counter-based hash with int64 Mul/BitwiseAnd/BitwiseXor and
  Div for the right shifts of non-negative values, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.backends.onnx.emitter import Emitter, Kernel, registrar
from pockengine.ir import DType, Node
from pockengine.ops._window import Window, check_pair
from pockengine.ops.elementwise import _mix32
from pockengine.ops.pool import _avg_divisor

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


def _pair(node: Node, key: str, minimum: int = 0) -> tuple[int, int]:
    return check_pair(node.op, key, node.attrs[key], minimum)


def _geometry(node: Node) -> dict[str, Any]:
    p = _pair(node, "padding")
    return {
        "strides": list(_pair(node, "stride", 1)),
        "pads": [p[0], p[1], p[0], p[1]],
        "dilations": list(_pair(node, "dilation", 1)),
        "group": int(node.attrs["groups"]),  # type: ignore[arg-type]
    }


def _crop(
    em: Emitter, x: str, starts: Sequence[int], stops: Sequence[int], axes: Sequence[int]
) -> str:
    return em.op("Slice", x, em.ints(starts), em.ints(stops), em.ints(axes))


# -- convolution --------------------------------------------------------------------------


@_k("conv2d")
def _conv2d(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Conv", *x, out=out[0], **_geometry(node))


@_k("conv2d_input_grad")
def _conv2d_input_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    geo = _geometry(node)
    (_, _, kh, kw), gy = node.inputs[1].shape, node.inputs[0].shape
    x_shape = node.output.shape
    extra = []
    for axis, k in ((0, kh), (1, kw)):
        s, d, p = geo["strides"][axis], geo["dilations"][axis], geo["pads"][axis]
        covered = (gy[2 + axis] - 1) * s + (k - 1) * d + 1 - 2 * p
        extra.append(x_shape[2 + axis] - covered)
    em.op("ConvTranspose", *x, out=out[0], output_padding=extra, **geo)


@_k("conv2d_weight_grad")
def _conv2d_weight_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    (n, _, h, w), (_, o, ho, wo) = node.inputs[0].shape, node.inputs[1].shape
    (_, cg, kh, kw), geo = node.output.shape, _geometry(node)
    g = geo["group"]
    xs = em.op("Reshape", x[0], em.ints([n, g, cg, h, w]))
    xs = em.op("Reshape", em.op("Transpose", xs, perm=[2, 1, 0, 3, 4]), em.ints([cg, g * n, h, w]))
    gs = em.op("Reshape", x[1], em.ints([n, g, o // g, ho, wo]))
    gs = em.op("Reshape", em.op("Transpose", gs, perm=[1, 2, 0, 3, 4]), em.ints([o, n, ho, wo]))
    full = em.op(
        "Conv",
        xs,
        gs,
        strides=geo["dilations"],
        dilations=geo["strides"],
        pads=geo["pads"],
        group=g,
    )
    gw = em.op("Transpose", full, perm=[1, 0, 2, 3])
    em.op("Slice", gw, em.ints([0, 0]), em.ints([kh, kw]), em.ints([2, 3]), out=out[0])


# -- pooling ------------------------------------------------------------------------------


def _pool_window(node: Node, x_shape: tuple[int, ...], out_hw: Sequence[int]) -> Window:
    dilation = _pair(node, "dilation", 1) if "dilation" in node.attrs else (1, 1)
    return Window(
        (x_shape[-2], x_shape[-1]),
        (out_hw[0], out_hw[1]),
        _pair(node, "kernel", 1),
        _pair(node, "stride", 1),
        _pair(node, "padding"),
        dilation,
    )


def _batched(em: Emitter, x: str, rank: int) -> str:
    return x if rank == 4 else em.op("Unsqueeze", x, em.ints([0]))


def _unbatched(em: Emitter, x: str, rank: int, out: str) -> None:
    if rank == 4:
        em.op("Identity", x, out=out)
    else:
        em.op("Squeeze", x, em.ints([0]), out=out)


def _after(win: Window) -> list[int]:
    """Right padding that covers the last window, as the reference kernel pads."""
    return [
        max(p, (o - 1) * s + d * (k - 1) + 1 - size - p)
        for p, o, s, d, k, size in zip(
            win.padding, win.out_hw, win.stride, win.dilation, win.kernel, win.in_hw, strict=True
        )
    ]


def _max_pool(em: Emitter, x: str, win: Window, indices: bool) -> list[str]:
    """MaxPool with explicit end padding instead of ceil_mode: ONNX's ceil_mode keeps a last
    window that starts in the right padding (ATen drops it); with the end padding the
    floor formula gives the reference size exactly."""
    (ph, pw), (ah, aw) = win.padding, _after(win)
    attrs = {
        "kernel_shape": list(win.kernel),
        "strides": list(win.stride),
        "pads": [ph, pw, ah, aw],
        "dilations": list(win.dilation),
    }
    outs = [em.tmp(), em.tmp()] if indices else [em.tmp()]
    return em.op_multi("MaxPool", x, outs=outs, **attrs)


@_k("max_pool2d")
def _max_pool2d(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    rank = node.inputs[0].type.rank
    win = _pool_window(node, node.inputs[0].shape, node.output.shape[-2:])
    (y,) = _max_pool(em, _batched(em, x[0], rank), win, indices=False)
    _unbatched(em, y, rank, out[0])


@_k("max_pool2d_grad")
def _max_pool2d_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gy, src = node.inputs
    win = _pool_window(node, src.shape, gy.shape[-2:])
    _, index = _max_pool(em, _batched(em, x[1], src.type.rank), win, indices=True)
    flat = [src.type.numel]
    zeros = em.op(
        "ConstantOfShape",
        em.ints(flat),
        value=em.onnx.numpy_helper.from_array(np.zeros(1, src.dtype.to_numpy())),
    )
    scattered = em.op(
        "ScatterElements",
        zeros,
        em.op("Reshape", index, em.ints([-1])),
        em.op("Reshape", x[0], em.ints([-1])),
        axis=0,
        reduction="add",
    )
    em.op("Reshape", scattered, em.ints(src.shape), out=out[0])


def _avg_divisor_const(em: Emitter, node: Node, win: Window, dtype: DType) -> str:
    override = node.attrs["divisor_override"]
    assert override is None or isinstance(override, int)
    divisor = _avg_divisor(win, bool(node.attrs["count_include_pad"]), override)
    return em.const(divisor.astype(dtype.to_numpy()))


def _ones_kernel(em: Emitter, win: Window, dtype: DType) -> str:
    return em.const(np.ones((1, 1, *win.kernel), dtype=dtype.to_numpy()))


def _planes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-2], dtype=np.int64))


@_k("avg_pool2d")
def _avg_pool2d(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    src, dt = node.inputs[0], node.inputs[0].dtype
    win = _pool_window(node, src.shape, node.output.shape[-2:])
    (h, w), (ph, pw), (sh, sw) = win.in_hw, win.padding, win.stride
    planes = em.op("Reshape", x[0], em.ints([_planes(src.shape), 1, h, w]))
    after = _after(win)
    padded = em.op("Pad", planes, em.ints([0, 0, ph, pw, 0, 0, after[0], after[1]]))
    total = em.op("Conv", padded, _ones_kernel(em, win, dt), strides=[sh, sw])
    total = _crop(em, total, [0, 0], list(win.out_hw), [2, 3])
    mean = em.op("Div", total, _avg_divisor_const(em, node, win, dt))
    em.op("Reshape", mean, em.ints(node.output.shape), out=out[0])


@_k("avg_pool2d_grad")
def _avg_pool2d_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gy, dt = node.inputs[0], node.inputs[0].dtype
    x_shape = node.output.shape
    win = _pool_window(node, x_shape, gy.shape[-2:])
    (h, w), (ph, pw) = win.in_hw, win.padding
    g = em.op("Div", x[0], _avg_divisor_const(em, node, win, dt))
    g = em.op("Reshape", g, em.ints([_planes(x_shape), 1, *win.out_hw]))
    spread = em.op("ConvTranspose", g, _ones_kernel(em, win, dt), strides=list(win.stride))
    reach = [(o - 1) * s + k for o, s, k in zip(win.out_hw, win.stride, win.kernel, strict=True)]
    short = [max(0, p + size - r) for p, size, r in zip((ph, pw), (h, w), reach, strict=True)]
    if any(short):
        spread = em.op("Pad", spread, em.ints([0, 0, 0, 0, 0, 0, short[0], short[1]]))
    crop = _crop(em, spread, [ph, pw], [ph + h, pw + w], [2, 3])
    em.op("Reshape", crop, em.ints(x_shape), out=out[0])


# -- normalisation ------------------------------------------------------------------------


def _channel(em: Emitter, v: str, rank: int, c: int) -> str:
    return em.op("Reshape", v, em.ints([c] + [1] * (rank - 2)))


@_k("batch_norm")
def _batch_norm(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    src = node.inputs[0]
    rank, c, dt = src.type.rank, src.shape[1], src.dtype
    axes = em.ints([0, *range(2, rank)])
    mean = em.op("ReduceMean", x[0], axes, keepdims=1)
    d = em.op("Sub", x[0], mean)
    var = em.op("ReduceMean", em.op("Mul", d, d), axes, keepdims=0)
    em.op("Reshape", mean, em.ints([c]), out=out[1])
    em.op("Identity", var, out=out[2])
    scale = em.op("Div", x[1], em.op("Sqrt", em.op("Add", var, em.scalar(_eps(node), dt))))
    scaled = em.op("Mul", d, _channel(em, scale, rank, c))
    em.op("Add", scaled, _channel(em, x[2], rank, c), out=out[0])


def _eps(node: Node) -> float:
    eps = node.attrs["eps"]
    assert isinstance(eps, int | float)
    return float(eps)


@_k("batch_norm_grad")
def _batch_norm_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gy, src, w, mean, var = x
    shape, dt = node.inputs[1].shape, node.inputs[1].dtype
    rank, c = len(shape), shape[1]
    n = em.scalar(float(node.inputs[1].type.numel // c), dt)
    axes = em.ints([0, *range(2, rank)])
    rstd = em.op("Reciprocal", em.op("Sqrt", em.op("Add", var, em.scalar(_eps(node), dt))))
    xhat = em.op("Mul", em.op("Sub", src, _channel(em, mean, rank, c)), _channel(em, rstd, rank, c))
    gb = em.op("ReduceSum", gy, axes, keepdims=0, out=out[2])
    gw = em.op("ReduceSum", em.op("Mul", gy, xhat), axes, keepdims=0, out=out[1])
    xhat = em.op("Mul", xhat, _channel(em, em.op("Div", gw, n), rank, c))
    gx = em.op("Sub", em.op("Sub", gy, _channel(em, em.op("Div", gb, n), rank, c)), xhat)
    em.op("Mul", gx, _channel(em, em.op("Mul", w, rstd), rank, c), out=out[0])


def _ln_axes(node: Node) -> tuple[list[int], list[int]]:
    """The normalised axes and the leading ones (x is input 1 of the grad, 0 of the op)."""
    src = node.inputs[1] if node.op == "layer_norm_grad" else node.inputs[0]
    rank, ndim = src.type.rank, int(node.attrs["ndim"])  # type: ignore[arg-type]
    return list(range(rank - ndim, rank)), list(range(rank - ndim))


@_k("layer_norm")
def _layer_norm(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    axes, _ = _ln_axes(node)
    dt = node.inputs[0].dtype
    mean = em.op("ReduceMean", x[0], em.ints(axes), keepdims=1, out=out[1])
    d = em.op("Sub", x[0], mean)
    var = em.op("ReduceMean", em.op("Mul", d, d), em.ints(axes), keepdims=1)
    rstd = em.op(
        "Reciprocal", em.op("Sqrt", em.op("Add", var, em.scalar(_eps(node), dt))), out=out[2]
    )
    y = em.op("Mul", em.op("Mul", d, rstd), x[1])
    em.op("Add", y, x[2], out=out[0])


def _sum_lead(em: Emitter, v: str, lead: list[int], out: str) -> None:
    if lead:
        em.op("ReduceSum", v, em.ints(lead), keepdims=0, out=out)
    else:
        em.op("Identity", v, out=out)


@_k("layer_norm_grad")
def _layer_norm_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gy, src, w, mean, rstd = x
    axes, lead = _ln_axes(node)
    xhat = em.op("Mul", em.op("Sub", src, mean), rstd)
    _sum_lead(em, gy, lead, out[2])
    _sum_lead(em, em.op("Mul", gy, xhat), lead, out[1])
    gxhat = em.op("Mul", gy, w)
    gx = em.op("Sub", gxhat, em.op("ReduceMean", gxhat, em.ints(axes), keepdims=1))
    proj = em.op("ReduceMean", em.op("Mul", gxhat, xhat), em.ints(axes), keepdims=1)
    gx = em.op("Sub", gx, em.op("Mul", xhat, proj))
    em.op("Mul", gx, rstd, out=out[0])


# -- dropout mask ---------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix(em: Emitter, h: str) -> str:
    """The hash's bijection of [0, 2**32) on int64 tensors (see random_mask's docstring)."""

    def shift(v: str, bits: int) -> str:  # v >= 0, so the arithmetic shift is a division
        return em.op("Div", v, em.scalar(1 << bits, DType.I64))

    def mul_mask(v: str, c: int) -> str:
        return em.op(
            "BitwiseAnd", em.op("Mul", v, em.scalar(c, DType.I64)), em.scalar(_M32, DType.I64)
        )

    h = em.op("BitwiseXor", h, shift(h, 16))
    h = mul_mask(h, 0x7FEB352D)
    h = em.op("BitwiseXor", h, shift(h, 15))
    h = mul_mask(h, 0x6A09E667)
    return em.op("BitwiseXor", h, shift(h, 16))


@_k("random_mask")
def _random_mask(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    shape = node.output.shape
    p, salt = float(node.attrs["p"]), int(node.attrs["salt"])  # type: ignore[arg-type]
    n = int(np.prod(shape, dtype=np.int64))
    m32 = em.scalar(_M32, DType.I64)
    salted = int(_mix32(np.asarray(salt & _M32, dtype=np.int64)))
    low = em.op("BitwiseAnd", x[0], m32)
    high = em.op("Div", em.op("Sub", x[0], low), em.scalar(1 << 32, DType.I64))  # exact
    key = _mix(em, em.op("BitwiseXor", em.scalar(salted, DType.I64), low))
    key = _mix(em, em.op("BitwiseXor", key, em.op("BitwiseAnd", high, m32)))
    index = em.op(
        "Range", em.scalar(0, DType.I64), em.scalar(n, DType.I64), em.scalar(1, DType.I64)
    )
    h = _mix(em, em.op("BitwiseXor", key, em.op("BitwiseAnd", index, m32)))
    if n > _M32:
        h = em.op("BitwiseXor", h, em.op("Div", index, em.scalar(1 << 32, DType.I64)))
    h = _mix(em, h)
    kept = em.op("GreaterOrEqual", h, em.scalar(math.ceil(p * 2.0**32), DType.I64))
    scale = em.scalar(1.0 / (1.0 - p) if p < 1.0 else 0.0, DType.F32)
    mask = em.op("Where", kept, scale, em.scalar(0.0, DType.F32))
    em.op("Reshape", mask, em.ints(shape), out=out[0])
