"""JAX converters: creation, views, slicing, joining, gather, dot_general."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pockengine.frontend import compose
from pockengine.frontend.jax.converters import JCtx, primitive
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


@primitive("iota")
def _iota(cx: JCtx) -> Value:
    t = cx.out_type
    dim = int(cx.params["dimension"])
    index = cx.call("arange", start=0, stop=t.shape[dim], step=1, dtype=str(t.dtype))
    shape = tuple(n if d == dim else 1 for d, n in enumerate(t.shape))
    return cx.broadcast(cx.reshape(index, shape), t.shape)


@primitive("reshape")
def _reshape(cx: JCtx, x: Value, *_: Value) -> Value:
    if cx.params.get("dimensions") is not None:
        raise CompileError("reshape with dimensions (a transpose first) is not supported")
    return cx.reshape(x, cx.out_type.shape)


@primitive("squeeze", "expand_dims")
def _squeeze(cx: JCtx, x: Value) -> Value:
    return cx.reshape(x, cx.out_type.shape)


@primitive("broadcast_in_dim")
def _broadcast_in_dim(cx: JCtx, x: Value, *_: Value) -> Value:
    """Operand axis i goes to result axis broadcast_dimensions[i]; the others are new."""
    shape = cx.out_type.shape
    dims = tuple(int(d) for d in cx.params["broadcast_dimensions"])
    if list(dims) != sorted(dims):
        raise CompileError(f"broadcast_in_dim with unordered dimensions {dims}")
    placed = [1] * len(shape)
    for axis, d in enumerate(dims):
        placed[d] = x.shape[axis]
    return cx.broadcast(cx.reshape(x, tuple(placed)), shape)


@primitive("transpose")
def _transpose(cx: JCtx, x: Value) -> Value:
    return cx.transpose(x, cx.params["permutation"])


@primitive("concatenate")
def _concatenate(cx: JCtx, *xs: Value) -> Value:
    dtype = cx.out_type.dtype
    parts = [cx.cast(x, dtype) for x in xs if x.type.numel > 0]
    if len(parts) == 1:
        return parts[0]
    return cx.call("concat", *parts, axis=int(cx.params["dimension"]))


def _crop(cx: JCtx, x: Value, axis: int, start: int, stop: int, step: int = 1) -> Value:
    if (start, stop, step) == (0, x.shape[axis], 1):
        return x
    return cx.call("slice", x, axis=axis, start=start, stop=stop, step=step)


@primitive("slice")
def _slice(cx: JCtx, x: Value) -> Value:
    starts, limits = cx.params["start_indices"], cx.params["limit_indices"]
    strides = cx.params.get("strides") or (1,) * len(starts)
    for axis, (lo, hi, step) in enumerate(zip(starts, limits, strides, strict=True)):
        x = _crop(cx, x, axis, int(lo), int(hi), int(step))
    return x


@primitive("split")
def _split(cx: JCtx, x: Value) -> list[Value]:
    axis = int(cx.params["axis"])
    parts, start = [], 0
    for size in cx.params["sizes"]:
        parts.append(_crop(cx, x, axis, start, start + int(size)))
        start += int(size)
    return parts


@primitive("dynamic_slice")
def _dynamic_slice(cx: JCtx, x: Value, *starts: Value) -> Value:
    """Static starts only; like XLA, a start is clamped so the slice stays in bounds."""
    for axis, (start, size) in enumerate(zip(starts, cx.params["slice_sizes"], strict=True)):
        first = int(cx.static(start, "dynamic_slice start indices").reshape(()))
        first = min(max(first, 0), x.shape[axis] - int(size))
        x = _crop(cx, x, axis, first, first + int(size))
    return x


@primitive("pad")
def _pad(cx: JCtx, x: Value, fill: Value) -> Value:
    config = [tuple(int(v) for v in c) for c in cx.params["padding_config"]]
    if any(interior for _, _, interior in config):
        raise CompileError("interior padding is not supported")
    value = float(cx.static(fill, "the padding value").reshape(()))
    grow = tuple((max(lo, 0), max(hi, 0)) for lo, hi, _ in config)
    out = x if not any(lo or hi for lo, hi in grow) else cx.call("pad", x, pads=grow, value=value)
    for axis, (lo, hi, _) in enumerate(config):
        size = out.shape[axis]
        out = _crop(cx, out, axis, -min(lo, 0), size + min(hi, 0))
    return out


# -- gather -------------------------------------------------------------------------


@primitive("gather")
def _gather(cx: JCtx, x: Value, indices: Value) -> Value:
    """The two shapes of gather that jnp emits for indexing: ``take_along_axis`` (every
    other axis a batching axis) and ``x[i]`` / ``jnp.take`` (whole slices of the other
    axes). Indices are assumed in bounds (XLA's clamping and fill modes are not modelled)."""
    dn = cx.params["dimension_numbers"]
    idx = cx.cast(indices, DType.I64)
    if tuple(dn.operand_batching_dims):
        return _take_along_axis(cx, x, idx, dn)
    return _take(cx, x, idx, dn)


def _take_along_axis(cx: JCtx, x: Value, idx: Value, dn: object) -> Value:
    (axis,) = tuple(getattr(dn, "start_index_map", ()))
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    aligned = batching == tuple(getattr(dn, "start_indices_batching_dims", ()))
    others = tuple(d for d in range(x.type.rank) if d != axis)
    if not aligned or batching != others or tuple(getattr(dn, "offset_dims", ())):
        raise CompileError(f"gather with dimension numbers {dn} is not supported")
    index = cx.reshape(idx, idx.shape[:-1])
    return cx.call("gather", x, index, axis=axis)


def _take(cx: JCtx, x: Value, idx: Value, dn: object) -> Value:
    axes = tuple(int(a) for a in getattr(dn, "start_index_map", ()))
    collapsed = tuple(sorted(int(a) for a in getattr(dn, "collapsed_slice_dims", ())))
    sizes = tuple(int(s) for s in cx.params["slice_sizes"])
    kept = [d for d in range(x.type.rank) if d not in axes]
    if collapsed != tuple(sorted(axes)) or any(sizes[d] != x.shape[d] for d in kept):
        raise CompileError(f"gather with dimension numbers {dn} is not supported")
    order = sorted(range(len(axes)), key=lambda k: axes[k])
    picks = [cx.reshape(_crop(cx, idx, idx.type.rank - 1, k, k + 1), idx.shape[:-1]) for k in order]
    out = cx.call("index", x, *picks, axes=tuple(sorted(axes)))
    return _to_gather_layout(cx, out, sorted(axes), kept, tuple(getattr(dn, "offset_dims", ())))


def _to_gather_layout(
    cx: JCtx, out: Value, axes: list[int], kept: list[int], offset_dims: tuple[int, ...]
) -> Value:
    """NumPy indexing puts the index shape in place of adjacent indexed axes, else first;
    gather puts the kept axes at ``offset_dims`` and the index shape in the rest."""
    batch_rank = out.type.rank - len(kept)
    adjacent = axes == list(range(axes[0], axes[0] + len(axes)))
    lead = axes[0] if adjacent else 0
    kept_pos = [k if k < lead else k - len(axes) + batch_rank for k in kept]
    batch_pos = [lead + i for i in range(batch_rank)]
    perm = [0] * out.type.rank
    batch_iter = iter(batch_pos)
    kept_iter = iter(kept_pos)
    for d in range(out.type.rank):
        perm[d] = next(kept_iter) if d in offset_dims else next(batch_iter)
    return cx.transpose(out, perm)


# -- dot_general ----------------------------------------------------------------------


@primitive("dot_general")
def _dot_general(cx: JCtx, lhs: Value, rhs: Value) -> Value:
    (lc, rc), (lb, rb) = cx.params["dimension_numbers"]
    lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    dtype = cx.out_type.dtype
    lhs, rhs = cx.cast(lhs, dtype), cx.cast(rhs, dtype)
    if not lb and len(lc) == 1 and lc[0] == lhs.type.rank - 1 and rhs.type.rank == 2:
        # x @ W (Dense) or x @ W.T: the matmul itself, as torch's linear lowers
        weight = rhs if rc[0] == 0 else cx.transpose(rhs, (1, 0))
        return cx.call("matmul", lhs, weight)
    lfree = [d for d in range(lhs.type.rank) if d not in lc + lb]
    rfree = [d for d in range(rhs.type.rank) if d not in rc + rb]
    batch = tuple(lhs.shape[d] for d in lb)
    k = _prod(lhs.shape[d] for d in lc)
    m, n = _prod(lhs.shape[d] for d in lfree), _prod(rhs.shape[d] for d in rfree)
    a = cx.reshape(cx.transpose(lhs, (*lb, *lfree, *lc)), (*batch, m, k))
    b = cx.reshape(cx.transpose(rhs, (*rb, *rc, *rfree)), (*batch, k, n))
    return cx.reshape(cx.call("matmul", a, b), cx.out_type.shape)


def _prod(sizes: Iterable[int]) -> int:
    return int(math.prod(sizes))


@primitive("rev")
def _rev(cx: JCtx, x: Value) -> Value:
    """``jnp.flip``: each listed axis read backwards."""
    for axis in cx.params["dimensions"]:
        x = compose.flip_axis(cx, x, int(axis))
    return x
