"""ONNX converters: shapes (known at compile time), views, slicing, gathering, padding."""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.frontend.onnx.converters import (
    Ctx,
    Operand,
    const_ints,
    ints_attr,
    norm_axis,
    onnx_op,
)
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


@onnx_op("Shape")
def _shape(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Operand:
    x = ins[0]
    shape = x.shape if isinstance(x, Value) else np.asarray(x).shape
    rank = len(shape)
    start = int(attrs.get("start", 0))
    end = int(attrs.get("end", rank))
    start, end = (min(max(v + rank if v < 0 else v, 0), rank) for v in (start, end))
    return np.asarray(shape[start:end], dtype=np.int64)


@onnx_op("Size")
def _size(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Operand:
    x = ins[0]
    shape = x.shape if isinstance(x, Value) else np.asarray(x).shape
    return np.asarray(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)


def _reshape(cx: Ctx, x: Value, shape: tuple[int, ...]) -> Value:
    return x if x.shape == shape else cx.call("reshape", x, shape=shape)


@onnx_op("Reshape")
def _reshape_op(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    dims = const_ints(ins[1], "the shape of Reshape")
    if not attrs.get("allowzero", 0):
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        dims[dims.index(-1)] = x.type.numel // max(known, 1)
    return _reshape(cx, x, tuple(dims))


@onnx_op("Flatten")
def _flatten(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    axis = norm_axis(int(attrs.get("axis", 1)), x.type.rank + 1)
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    return _reshape(cx, x, (outer, x.type.numel // max(outer, 1)))


@onnx_op("Transpose")
def _transpose(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    perm = tuple(ints_attr(attrs, "perm", list(reversed(range(x.type.rank)))))
    return x if perm == tuple(range(x.type.rank)) else cx.call("transpose", x, perm=perm)


def _axes(ins: list[Operand], attrs: dict[str, Any]) -> list[int] | None:
    if len(ins) > 1 and ins[1] is not None:
        return const_ints(ins[1], "axes")
    return None if "axes" not in attrs else ints_attr(attrs, "axes")


@onnx_op("Squeeze")
def _squeeze(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    axes = _axes(ins, attrs)
    drop = (
        {i for i, d in enumerate(x.shape) if d == 1}
        if axes is None
        else {norm_axis(a, x.type.rank) for a in axes}
    )
    return _reshape(cx, x, tuple(d for i, d in enumerate(x.shape) if i not in drop))


@onnx_op("Unsqueeze")
def _unsqueeze(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    axes = _axes(ins, attrs) or []
    rank = x.type.rank + len(axes)
    new = {norm_axis(a, rank) for a in axes}
    dims = iter(x.shape)
    return _reshape(cx, x, tuple(1 if i in new else next(dims) for i in range(rank)))


@onnx_op("Expand")
def _expand(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    target = tuple(int(d) for d in np.broadcast_shapes(x.shape, tuple(const_ints(ins[1], "shape"))))
    return x if target == x.shape else cx.call("broadcast_to", x, shape=target)


@onnx_op("Tile")
def _tile(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    for axis, r in enumerate(const_ints(ins[1], "repeats")):
        if r == 1:
            continue
        shape = x.shape
        lifted = _reshape(cx, x, (*shape[:axis], 1, *shape[axis:]))
        wide = cx.call("broadcast_to", lifted, shape=(*shape[:axis], r, *shape[axis:]))
        x = _reshape(cx, wide, (*shape[:axis], r * shape[axis], *shape[axis + 1 :]))
    return x


@onnx_op("Concat")
def _concat(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    anchor = next((x for x in ins if isinstance(x, Value)), None)
    parts = [cx.value(x) if anchor is None else cx.like(x, anchor) for x in ins if x is not None]
    parts = [p for p in parts if p.type.numel or p.type.rank != 1]  # ONNX allows empty pieces
    axis = norm_axis(int(attrs["axis"]), parts[0].type.rank)
    return parts[0] if len(parts) == 1 else cx.call("concat", *parts, axis=axis)


def _clamp_bound(v: int, dim: int) -> int:
    return min(max(v + dim if v < 0 else v, 0), dim)


@onnx_op("Slice")
def _slice(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    if cx.opset < 10:
        starts, ends = ints_attr(attrs, "starts"), ints_attr(attrs, "ends")
        axes, steps = ints_attr(attrs, "axes", range(len(starts))), [1] * len(starts)
    else:
        starts, ends = const_ints(ins[1], "Slice starts"), const_ints(ins[2], "Slice ends")
        more = [*ins[3:], None, None]
        count = len(starts)
        axes = const_ints(more[0], "Slice axes") if more[0] is not None else list(range(count))
        steps = const_ints(more[1], "Slice steps") if more[1] is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        ax = norm_axis(axis, x.type.rank)
        dim = x.shape[ax]
        if step < 0:  # backwards (a flip): the positions Python's slicing gives, by index
            picked = np.arange(dim)[slice(start, end, step)]
            x = cx.call("index", x, cx.value(picked.astype(np.int64)), axes=(ax,))
            continue
        if step == 0:
            raise CompileError("Slice with step 0")
        lo, hi = _clamp_bound(start, dim), _clamp_bound(end, dim)
        if (lo, hi, step) != (0, dim, 1):
            x = cx.call("slice", x, axis=ax, start=lo, stop=max(lo, hi), step=step)
    return x


@onnx_op("Split")
def _split(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, ...]:
    x = cx.value(ins[0])
    axis = norm_axis(int(attrs.get("axis", 0)), x.type.rank)
    dim = x.shape[axis]
    if len(ins) > 1 and ins[1] is not None:
        sizes = const_ints(ins[1], "Split sizes")
    elif "split" in attrs:
        sizes = ints_attr(attrs, "split")
    else:
        n = int(attrs.get("num_outputs", cx.n_outputs))
        chunk = -(-dim // n)
        sizes = [min(chunk, dim - i * chunk) for i in range(n)]
    outs, offset = [], 0
    for size in sizes:
        outs.append(cx.call("slice", x, axis=axis, start=offset, stop=offset + size, step=1))
        offset += size
    return tuple(outs)


@onnx_op("Pad")
def _pad(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    if attrs.get("mode", "constant") != "constant":
        raise CompileError(f"Pad mode {attrs['mode']!r} is not supported (constant only)")
    x = cx.value(ins[0])
    rank = x.type.rank
    flat = const_ints(ins[1], "pads") if cx.opset >= 11 else ints_attr(attrs, "pads")
    more = [*ins[2:], None, None]
    value = 0.0 if more[0] is None else float(np.asarray(more[0]).reshape(-1)[0])
    axes = (
        list(range(rank))
        if more[1] is None
        else [norm_axis(a, rank) for a in const_ints(more[1], "Pad axes")]
    )
    pairs = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        pairs[axis] = (flat[i], flat[i + len(axes)])
    if any(p < 0 for pair in pairs for p in pair):
        raise CompileError("Pad with negative amounts (cropping) is not supported")
    return cx.call("pad", x, pads=tuple(pairs), value=value)


# -- gathering -------------------------------------------------------------------------------


def _index_value(cx: Ctx, x: Operand) -> Value:
    v = cx.value(x, "indices")
    if v.dtype not in (DType.I64, DType.I32):
        raise CompileError(f"indices must be int64 or int32, got {v.type}")
    return v


@onnx_op("Gather")
def _gather(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    data, ids = cx.value(ins[0], "data"), _index_value(cx, ins[1])
    axis = norm_axis(int(attrs.get("axis", 0)), data.type.rank)
    if axis == 0 and data.type.rank == 2 and data.dtype.is_float:
        return cx.call("embedding", data, ids, padding_idx=None)
    return cx.call("index", data, ids, axes=(axis,))


@onnx_op("GatherElements")
def _gather_elements(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    data, index = cx.value(ins[0], "data"), _index_value(cx, ins[1])
    return cx.call("gather", data, index, axis=norm_axis(int(attrs.get("axis", 0)), data.type.rank))


@onnx_op("GatherND")
def _gather_nd(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    if attrs.get("batch_dims", 0):
        raise CompileError("GatherND with batch_dims > 0 is not supported")
    data, index = cx.value(ins[0], "data"), ins[1]
    depth = (index.shape if isinstance(index, Value) else np.asarray(index).shape)[-1]
    columns = []
    for k in range(depth):
        if isinstance(index, np.ndarray):
            columns.append(cx.value(np.ascontiguousarray(index[..., k])))
            continue
        iv = _index_value(cx, index)
        col = cx.call("slice", iv, axis=iv.type.rank - 1, start=k, stop=k + 1, step=1)
        columns.append(_reshape(cx, col, iv.shape[:-1]))
    return cx.call("index", data, *columns, axes=tuple(range(depth)))
