"""ATen converters that copy data into a new layout: repeat, slice_scatter, as_strided.

Each lowers to the IR's views and joins (reshape, broadcast_to, transpose, slice,
concat), whose gradients autodiff already has. ``as_strided`` is about storage, which
IR values do not have: it is converted where its result is a reshape or a transposition
of its input's logical elements (as adaptive pooling's decomposition restrides a
[B, C, 1, 1] mean); any other striding (overlapping windows, gaps) is an error naming
the sizes and strides.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from pockengine.frontend.torch.converters import Ctx, aten, norm_dim
from pockengine.ir import CompileError, Value
from pockengine.ir.arrays import Array

__all__: list[str] = []


@aten("repeat.default")
def _repeat(cx: Ctx, a: Value, repeats: list[int]) -> Value:
    """Tile: a [d0, d1] repeated (r0, r1) is broadcast [r0, d0, r1, d1] -> [r0*d0, r1*d1]."""
    reps = [int(r) for r in repeats]
    if len(reps) < a.type.rank:
        raise CompileError(f"repeat needs at least {a.type.rank} repeats, got {reps}")
    dims = (1,) * (len(reps) - a.type.rank) + a.shape
    if all(r == 1 for r in reps):
        return a if dims == a.shape else cx.call("reshape", a, shape=dims)
    spread = tuple(d for pair in zip((1,) * len(dims), dims, strict=True) for d in pair)
    tiled = tuple(d for pair in zip(reps, dims, strict=True) for d in pair)
    x = cx.call("reshape", a, shape=spread)
    x = cx.call("broadcast_to", x, shape=tiled)
    return cx.call("reshape", x, shape=tuple(r * d for r, d in zip(reps, dims, strict=True)))


@aten("slice_scatter.default")
def _slice_scatter(
    cx: Ctx,
    a: Value,
    src: Value,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> Value:
    """``a`` with ``a[start:end]`` along ``dim`` replaced by ``src``: the untouched parts
    and ``src`` joined (what ``x[:, 1:] = y`` exports as)."""
    axis = norm_dim(dim, a.type.rank)
    size = a.shape[axis]
    lo = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    hi = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    if step != 1:
        raise CompileError(f"slice_scatter with step {step} is not supported (only step 1)")
    src = cx.cast(src, a.dtype)
    parts = []
    if lo > 0:
        parts.append(cx.call("slice", a, axis=axis, start=0, stop=lo, step=1))
    parts.append(src)
    if hi < size:
        parts.append(cx.call("slice", a, axis=axis, start=hi, stop=size, step=1))
    return parts[0] if len(parts) == 1 else cx.call("concat", *parts, axis=axis)


def _storage_positions(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Array:
    """Where each element of a tensor of ``shape``/``stride`` lies in its storage."""
    pos = np.full(shape, offset, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(shape, stride, strict=True)):
        view = [1] * len(shape)
        view[axis] = n
        pos = pos + (np.arange(n, dtype=np.int64) * s).reshape(view)
    return pos


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out contiguously in row-major order (the stride of a
    dim of size 1 is never read, so it may be anything)."""
    expected = 1
    for d, s in zip(reversed(shape), reversed(stride), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _is_reshape(cx: Ctx, size: tuple[int, ...], stride: tuple[int, ...], offset: Any) -> bool:
    """The common case without building index arrays: a contiguous input read contiguously
    from where it starts (a restride of size-1 dims, as adaptive pooling's)."""
    fake = cx.node.args[0].meta["val"]
    shape = tuple(int(d) for d in fake.shape)
    start = int(fake.storage_offset())
    return (
        math.prod(size) == math.prod(shape)
        and (offset is None or int(offset) == start)
        and _row_major(shape, tuple(int(s) for s in fake.stride()))
        and _row_major(size, stride)
    )


def _gathered(cx: Ctx, size: tuple[int, ...], stride: tuple[int, ...], offset: Any) -> Array:
    """The flat logical index in the input of each element of the as_strided result."""
    fake = cx.node.args[0].meta["val"]
    in_shape = tuple(int(d) for d in fake.shape)
    start = int(fake.storage_offset()) if offset is None else int(offset)
    held = _storage_positions(
        in_shape, tuple(int(s) for s in fake.stride()), int(fake.storage_offset())
    ).reshape(-1)
    order = np.argsort(held, kind="stable")
    wanted = _storage_positions(size, stride, start).reshape(-1)
    found = np.searchsorted(held[order], wanted)
    ok = found < len(held)
    ok[ok] = held[order][found[ok]] == wanted[ok]
    if not ok.all():
        raise CompileError(
            f"as_strided to size {list(size)}, stride {list(stride)} reads storage that the "
            f"input {list(in_shape)} (stride {list(fake.stride())}) does not hold"
        )
    return np.asarray(order[found])


@aten("as_strided.default")
def _as_strided(
    cx: Ctx, a: Value, size: list[int], stride: list[int], storage_offset: Any = None
) -> Value:
    """A reshape or a transposition of the input's elements; anything else is refused."""
    shape, strides = tuple(int(d) for d in size), tuple(int(s) for s in stride)
    if _is_reshape(cx, shape, strides, storage_offset):
        return a if a.shape == shape else cx.call("reshape", a, shape=shape)
    index = _gathered(cx, shape, strides, storage_offset)
    if len(index) == a.type.numel and np.array_equal(index, np.arange(len(index))):
        return a if a.shape == shape else cx.call("reshape", a, shape=shape)
    if len(index) == a.type.numel and a.type.rank <= 6:
        flat = np.arange(a.type.numel).reshape(a.shape)
        for perm in itertools.permutations(range(a.type.rank)):
            if np.array_equal(np.transpose(flat, perm).reshape(-1), index):
                moved = cx.call("transpose", a, perm=perm)
                return moved if moved.shape == shape else cx.call("reshape", moved, shape=shape)
    raise CompileError(
        f"as_strided of {a.type} to size {list(shape)}, stride {list(stride)} is no reshape or "
        f"transposition of its input ({math.prod(shape)} elements gathered in another order); "
        "only those are supported"
    )
