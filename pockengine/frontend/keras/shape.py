"""TF converters: static shapes, views, slicing, concatenation, gathering, padding."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pockengine.frontend.keras.converters import (
    Attrs,
    Ctx,
    Operand,
    const_ints,
    float_like,
    ir_dtype,
    norm_axis,
    tf_op,
)
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []

log = logging.getLogger(__name__)


def _shape_of(x: Operand) -> tuple[int, ...]:
    return x.shape if isinstance(x, Value) else tuple(np.asarray(x).shape)


@tf_op("Shape")
def _shape(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Operand:
    dtype = ir_dtype(attrs.get("out_type", "int32")).to_numpy()
    return np.asarray(_shape_of(ins[0]), dtype=dtype)


@tf_op("Size")
def _size(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Operand:
    dtype = ir_dtype(attrs.get("out_type", "int32")).to_numpy()
    return np.asarray(int(np.prod(_shape_of(ins[0]), dtype=np.int64)), dtype=dtype)


@tf_op("Rank")
def _rank(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Operand:
    return np.asarray(len(_shape_of(ins[0])), dtype=np.int32)


def reshape(cx: Ctx, x: Value, shape: tuple[int, ...]) -> Value:
    return x if x.shape == shape else cx.call("reshape", x, shape=shape)


@tf_op("Reshape")
def _reshape(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    dims = const_ints(ins[1], "the shape of Reshape")
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        dims[dims.index(-1)] = x.type.numel // max(known, 1)
    return reshape(cx, x, tuple(dims))


@tf_op("Transpose")
def _transpose(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    perm = tuple(norm_axis(p, x.type.rank) for p in const_ints(ins[1], "perm"))
    return x if perm == tuple(range(x.type.rank)) else cx.call("transpose", x, perm=perm)


@tf_op("ExpandDims")
def _expand_dims(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    axis = norm_axis(const_ints(ins[1], "axis")[0], x.type.rank + 1)
    return reshape(cx, x, (*x.shape[:axis], 1, *x.shape[axis:]))


@tf_op("Squeeze")
def _squeeze(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    given = list(attrs.get("squeeze_dims") or [])
    drop = {norm_axis(a, x.type.rank) for a in given} or {
        i for i, d in enumerate(x.shape) if d == 1
    }
    return reshape(cx, x, tuple(d for i, d in enumerate(x.shape) if i not in drop))


@tf_op("ConcatV2")
def _concat(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    parts = float_like(cx, ins[:-1])
    axis = norm_axis(const_ints(ins[-1], "axis")[0], parts[0].type.rank)
    return parts[0] if len(parts) == 1 else cx.call("concat", *parts, axis=axis)


@tf_op("Pack")
def _pack(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    parts = float_like(cx, ins)
    axis = norm_axis(int(attrs.get("axis", 0)), parts[0].type.rank + 1)
    lifted = [reshape(cx, p, (*p.shape[:axis], 1, *p.shape[axis:])) for p in parts]
    return lifted[0] if len(lifted) == 1 else cx.call("concat", *lifted, axis=axis)


def _slice_axis(cx: Ctx, x: Value, axis: int, start: int, stop: int, step: int) -> Value:
    dim = x.shape[axis]
    lo, hi = (min(max(v + dim if v < 0 else v, 0), dim) for v in (start, stop))
    if (lo, hi, step) == (0, dim, 1):
        return x
    return cx.call("slice", x, axis=axis, start=lo, stop=max(lo, hi), step=step)


@tf_op("StridedSlice")
def _strided_slice(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """Positive strides, begin/end/shrink masks; no ellipsis or new axes."""
    if attrs.get("ellipsis_mask", 0) or attrs.get("new_axis_mask", 0):
        raise CompileError("StridedSlice with an ellipsis or new axes is not supported")
    x = cx.value(ins[0])
    begin, end, strides = (const_ints(v, "StridedSlice bounds") for v in ins[1:4])
    keep = []
    for axis, (b, e, s) in enumerate(zip(begin, end, strides, strict=True)):
        if s < 1:
            raise CompileError(f"StridedSlice with stride {s} is not supported")
        dim = x.shape[axis]
        shrink = bool(attrs.get("shrink_axis_mask", 0) >> axis & 1)
        lo = 0 if attrs.get("begin_mask", 0) >> axis & 1 else b
        hi = dim if attrs.get("end_mask", 0) >> axis & 1 else e
        hi = (lo % dim) + 1 if shrink else hi
        x = _slice_axis(cx, x, axis, lo, hi, s)
        keep.append(not shrink)
    kept = tuple(d for i, d in enumerate(x.shape) if i >= len(keep) or keep[i])
    return reshape(cx, x, kept)


@tf_op("Slice")
def _slice(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    begin, size = const_ints(ins[1], "Slice begin"), const_ints(ins[2], "Slice size")
    for axis, (b, n) in enumerate(zip(begin, size, strict=True)):
        x = _slice_axis(cx, x, axis, b, x.shape[axis] if n == -1 else b + n, 1)
    return x


@tf_op("GatherV2")
def _gather(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    if attrs.get("batch_dims", 0):
        raise CompileError("GatherV2 with batch_dims is not supported")
    data, ids = cx.value(ins[0], "params"), cx.value(ins[1], "indices")
    if ids.dtype not in (DType.I64, DType.I32):
        raise CompileError(f"indices must be int32 or int64, got {ids.type}")
    axis = norm_axis(const_ints(ins[2], "axis")[0], data.type.rank)
    if axis == 0 and data.type.rank == 2 and data.dtype.is_float:
        return cx.call("embedding", data, ids, padding_idx=None)
    return cx.call("index", data, ids, axes=(axis,))


@tf_op("Pad", "PadV2")
def _pad(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    flat = const_ints(ins[1], "paddings")
    value = 0.0 if len(ins) < 3 else float(np.asarray(ins[2]).reshape(-1)[0])
    pairs = tuple((flat[2 * i], flat[2 * i + 1]) for i in range(x.type.rank))
    return cx.call("pad", x, pads=pairs, value=value)


@tf_op("BroadcastTo")
def _broadcast_to(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    shape = tuple(int(d) for d in np.broadcast_shapes(x.shape, tuple(const_ints(ins[1], "shape"))))
    return x if shape == x.shape else cx.call("broadcast_to", x, shape=shape)


def _fill_like(fill: int) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Operand:
        x = ins[0]
        dtype = x.dtype.to_numpy() if isinstance(x, Value) else np.asarray(x).dtype
        return np.full(_shape_of(x), fill, dtype=dtype)

    return convert


tf_op("ZerosLike")(_fill_like(0))
tf_op("OnesLike")(_fill_like(1))


@tf_op("IdentityN")
def _identity_n(cx: Ctx, ins: list[Operand], attrs: Attrs) -> tuple[Operand, ...]:
    """Each input passed through. ``tf.custom_gradient`` puts one around its function, with
    ``_gradient_op_type`` set: autodiff then differentiates the function's own ops, which is
    its custom gradient only where that gradient is exact, so this says so once per node."""
    if attrs.get("_gradient_op_type"):
        log.warning(
            "%s: a tf.custom_gradient is replaced by the gradient of the ops it wraps",
            cx.source or "IdentityN",
        )
    return tuple(ins)


def _blocks(ins: list[Operand], x: Value, what: str) -> tuple[list[int], list[list[int]]]:
    """The block shape and the [M, 2] paddings or crops of Space/BatchToSpaceND."""
    block = const_ints(ins[1], f"the block shape of {what}")
    flat = const_ints(ins[2], f"the paddings or crops of {what}")
    if len(flat) != 2 * len(block) or x.type.rank < 1 + len(block):
        raise CompileError(f"{what}: block {block} and pads {flat} do not fit {x.type}")
    return block, [flat[2 * i : 2 * i + 2] for i in range(len(block))]


@tf_op("SpaceToBatchND")
def _space_to_batch(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """[B, P1, .., PM, R..] (padded) -> [B, P1/b1, b1, ..] -> [b1, .., bM, B, P1/b1, .., R..]
    -> [b1*..*bM*B, P1/b1, .., PM/bM, R..]: how TF runs a dilated convolution."""
    x = cx.value(ins[0])
    block, pads = _blocks(ins, x, "SpaceToBatchND")
    m, rest = len(block), x.shape[1 + len(block) :]
    zeros = ((0, 0),) * len(rest)
    if any(lo or hi for lo, hi in pads):
        grown = ((0, 0), *((lo, hi) for lo, hi in pads), *zeros)
        x = cx.call("pad", x, pads=grown, value=0.0)
    batch, spatial = x.shape[0], x.shape[1 : 1 + m]
    if any(d % b for d, b in zip(spatial, block, strict=True)):
        raise CompileError(f"SpaceToBatchND: padded {list(spatial)} is not a multiple of {block}")
    split = [d for s, b in zip(spatial, block, strict=True) for d in (s // b, b)]
    x = reshape(cx, x, (batch, *split, *rest))
    perm = (*(2 + 2 * i for i in range(m)), 0, *(1 + 2 * i for i in range(m)))
    x = cx.call("transpose", x, perm=(*perm, *range(1 + 2 * m, x.type.rank)))
    outer = batch * int(np.prod(block))
    return reshape(cx, x, (outer, *(s // b for s, b in zip(spatial, block, strict=True)), *rest))


@tf_op("BatchToSpaceND")
def _batch_to_space(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """The inverse: [b1*..*bM*B, S1, .., R..] -> [B, S1*b1, .., SM*bM, R..], then cropped."""
    x = cx.value(ins[0])
    block, crops = _blocks(ins, x, "BatchToSpaceND")
    m, spatial, rest = len(block), x.shape[1 : 1 + len(block)], x.shape[1 + len(block) :]
    batch = x.shape[0] // int(np.prod(block))
    x = reshape(cx, x, (*block, batch, *spatial, *rest))
    perm = (m, *(d for i in range(m) for d in (m + 1 + i, i)))
    x = cx.call("transpose", x, perm=(*perm, *range(2 * m + 1, x.type.rank)))
    x = reshape(cx, x, (batch, *(s * b for s, b in zip(spatial, block, strict=True)), *rest))
    for axis, (lo, hi) in enumerate(crops, start=1):
        x = _slice_axis(cx, x, axis, lo, x.shape[axis] - hi, 1)
    return x
