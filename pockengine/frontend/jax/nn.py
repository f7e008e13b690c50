"""JAX converters: convolution and window reductions (pooling).

The IR's conv2d and pooling ops are NCHW with OIHW weights (torch's layout); JAX's
dimension numbers say where batch, feature and spatial axes are, so the converters
transpose into that layout and back. Transposes cost no FLOPs and the passes fold a
transpose followed by its inverse.
"""

from __future__ import annotations

from collections.abc import Sequence

from pockengine.frontend import compose
from pockengine.frontend.jax.converters import JCtx, primitive
from pockengine.ir import CompileError, Value

__all__: list[str] = []


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def _symmetric(pads: Sequence[tuple[int, int]], what: str) -> tuple[int, int] | None:
    """The per-axis padding when each axis pads equally on both sides, else None."""
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        raise CompileError(f"negative {what} padding is not supported")
    if all(lo == hi for lo, hi in pads):
        return (pads[0][0], pads[1][0])
    return None


@primitive("conv_general_dilated")
def _conv(cx: JCtx, lhs: Value, rhs: Value) -> Value:
    p = cx.params
    if int(p["batch_group_count"]) != 1:
        raise CompileError("batch-grouped convolution is not supported")
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = (tuple(int(d) for d in s) for s in dn)
    x = cx.transpose(lhs, lhs_spec)  # N, C, spatial...
    w = cx.transpose(rhs, rhs_spec)  # O, I, spatial...
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    strides = tuple(int(s) for s in p["window_strides"])
    dilation = tuple(int(d) for d in p["rhs_dilation"])
    if x.type.rank == 3:  # 1-d: a height of one
        x = cx.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        w = cx.reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        pads, strides, dilation = [(0, 0), *pads], (1, *strides), (1, *dilation)
    if x.type.rank != 4:
        raise CompileError(f"{x.type.rank - 2}-d convolution is not supported")
    spatial = tuple(cx.out_type.shape[d] for d in out_spec[2:])
    if any(int(d) != 1 for d in p["lhs_dilation"]):
        y = _lhs_dilated(cx, x, w, pads, strides, dilation, spatial)
        return cx.transpose(cx.reshape(y, (y.shape[0], y.shape[1], *spatial)), _inverse(out_spec))
    padding = _symmetric(pads, "convolution")
    if padding is None:
        x = cx.call("pad", x, pads=((0, 0), (0, 0), *pads), value=0.0)
        padding = (0, 0)
    y = cx.call(
        "conv2d",
        x,
        w,
        stride=strides,
        padding=padding,
        dilation=dilation,
        groups=int(p["feature_group_count"]),
    )
    y = cx.reshape(y, (y.shape[0], y.shape[1], *spatial))
    return cx.transpose(y, _inverse(out_spec))


def _lhs_dilated(
    cx: JCtx,
    x: Value,
    w: Value,
    pads: list[tuple[int, int]],
    strides: tuple[int, ...],
    dilation: tuple[int, ...],
    spatial: tuple[int, ...],
) -> Value:
    """A convolution of the input dilated by ``lhs_dilation`` (what ``lax.conv_transpose``
    and Flax's ConvTranspose make), NCHW and OIHW: the input gradient of the strided
    convolution it transposes, with the kernel flipped and its feature axes swapped per
    group, and that convolution's padding (K - 1) * d - pad on each side (negative where
    the output has rows no input reaches: ``compose.transposed_conv2d`` pads zeros)."""
    p = cx.params
    if any(int(s) != 1 for s in strides):
        raise CompileError("a convolution with both lhs dilation and window strides")
    lhs = tuple(int(d) for d in p["lhs_dilation"])
    lhs = (1, *lhs) if len(lhs) == 1 else lhs
    groups = int(p["feature_group_count"])
    o, i, kh, kw = w.shape
    per_group = cx.reshape(w, (groups, o // groups, i, kh, kw))
    w = cx.reshape(cx.transpose(per_group, (0, 2, 1, 3, 4)), (groups * i, o // groups, kh, kw))
    w = compose.flip_axis(cx, compose.flip_axis(cx, w, 2), 3)
    extent = [(k - 1) * d for k, d in zip((kh, kw), dilation, strict=True)]
    begin = [e - lo for e, (lo, _) in zip(extent, pads, strict=True)]
    end = [e - hi for e, (_, hi) in zip(extent, pads, strict=True)]
    out = (1, *spatial) if len(spatial) == 1 else spatial
    shape = (x.shape[0], w.shape[1] * groups, *out)
    pairs = ((begin[0], begin[1]), (end[0], end[1]))
    return compose.transposed_conv2d(
        cx, x, w, shape, (lhs[0], lhs[1]), pairs, (dilation[0], dilation[1]), groups
    )


def _window_layout(cx: JCtx, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(perm to N, C, H, W; the two spatial axes) for a window over a rank-4 (or rank-3,
    one spatial axis) input whose batch and channel axes have trivial windows."""
    p = cx.params
    trivial = {
        d
        for d in range(rank)
        if int(p["window_dimensions"][d]) == 1
        and int(p["window_strides"][d]) == 1
        and tuple(p["padding"][d]) == (0, 0)
    }
    if any(int(d) != 1 for d in p.get("base_dilation", ())):
        raise CompileError("pooling with base dilation is not supported")
    last = rank - 1
    if {0, last} <= trivial:  # channels last (Flax's NHWC)
        return (0, last, *range(1, last)), tuple(range(1, last))
    if {0, 1} <= trivial:
        return tuple(range(rank)), tuple(range(2, rank))
    raise CompileError(f"pooling window {p['window_dimensions']} has no batch and feature axes")


def _pool(cx: JCtx, x: Value, op: str) -> Value:
    p = cx.params
    perm, spatial = _window_layout(cx, x.type.rank)
    if len(spatial) not in (1, 2):
        raise CompileError(f"{len(spatial)}-d pooling is not supported")
    y = cx.transpose(x, perm)
    if len(spatial) == 1:
        y = cx.reshape(y, (y.shape[0], y.shape[1], 1, y.shape[2]))

    def pair(key: str) -> tuple[int, int]:
        values = [int(p[key][d]) if key in p else 1 for d in spatial]
        return (1, values[0]) if len(values) == 1 else (values[0], values[1])

    pads = [(int(p["padding"][d][0]), int(p["padding"][d][1])) for d in spatial]
    padding = _symmetric([(0, 0)] * (2 - len(pads)) + pads, "pooling")
    if padding is None:
        raise CompileError("pooling with asymmetric padding is not supported")
    window = {"kernel": pair("window_dimensions"), "stride": pair("window_strides"),
              "padding": padding, "ceil_mode": False}  # fmt: skip
    if op == "max_pool2d":
        y = cx.call(op, y, dilation=pair("window_dilation"), **window)
    elif pair("window_dilation") != (1, 1):
        raise CompileError("sum pooling with window dilation is not supported")
    else:  # avg_pool2d with a divisor of one is the window sum
        y = cx.call(op, y, count_include_pad=True, divisor_override=1, **window)
    nchw = tuple(cx.out_type.shape[d] for d in perm)
    return cx.transpose(cx.reshape(y, nchw), _inverse(perm))


@primitive("reduce_window_max")
def _reduce_window_max(cx: JCtx, x: Value) -> Value:
    return _pool(cx, x, "max_pool2d")


@primitive("reduce_window_sum")
def _reduce_window_sum(cx: JCtx, x: Value) -> Value:
    return _pool(cx, x, "avg_pool2d")
