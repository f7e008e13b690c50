"""Shared helpers of the op families: broadcasting, axes, sample inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import DType, Fact, ShapeError, TensorType

__all__ = [
    "EW_INPLACE",
    "broadcast_shapes",
    "norm_axes",
    "norm_axis",
    "np_dtype",
    "same_dtype",
]

# Elementwise, may write its result over a dying input, cheap enough to recompute: the
# facts of plain arithmetic and of most unary math.
EW_INPLACE = Fact.ELEMENTWISE | Fact.INPLACE | Fact.CHEAP


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError(f"shapes {list(shapes)} do not broadcast") from None


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def norm_axes(axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """Sorted non-negative axes; None (or an empty list, as ATen means it) is every axis."""
    if not axes:
        return tuple(range(rank))
    return tuple(sorted({norm_axis(a, rank) for a in axes}))


def same_dtype(op: str, *types: TensorType) -> DType:
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        raise ShapeError(f"{op} needs one dtype, got {sorted(str(d) for d in dtypes)}")
    return types[0].dtype


def np_dtype(dtype: str | DType) -> np.dtype[Any]:
    return DType(dtype).to_numpy()
