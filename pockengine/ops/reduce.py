"""Reductions over axes, and the sum_to that undoes broadcasting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import DType, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ops._common import Array, broadcast_shapes, norm_axes

__all__: list[str] = []


def _reduced_shape(x: TensorType, axes: Sequence[int] | None, keepdims: bool) -> tuple[int, ...]:
    ax = norm_axes(axes, x.rank)
    if keepdims:
        return tuple(1 if i in ax else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in ax)


def _reduce_flops(ins: tuple[TensorType, ...], outs: Any, attrs: Any) -> int:
    return ins[0].numel


@defop("sum", groups=("reduction",))
class Sum:
    """Forward: z = sum(x, axes). Backward: gx = broadcast_to(reshape(gz, kept), x.shape).

    A boolean input sums to i64, as in ATen.
    """

    flops = staticmethod(_reduce_flops)

    @staticmethod
    def infer(x: TensorType, *, axes: tuple[int, ...] | None, keepdims: bool) -> TensorType:
        dtype = DType.I64 if x.dtype is DType.BOOL else x.dtype
        return TensorType(_reduced_shape(x, axes, keepdims), dtype)

    @staticmethod
    def kernel(x: Array, *, axes: tuple[int, ...] | None, keepdims: bool) -> Array:
        ax = norm_axes(axes, x.ndim)
        dtype = np.int64 if x.dtype == np.bool_ else x.dtype
        return np.asarray(np.sum(x, axis=ax, keepdims=keepdims, dtype=dtype))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        kept = _reduced_shape(x.type, c.attrs["axes"], True)  # type: ignore[arg-type]
        g = c.call("reshape", c.ct, shape=kept)
        return (c.call("broadcast_to", g, shape=x.shape),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((2, 3, 4))
        return [
            Sample((x,), {"axes": (1,), "keepdims": False}),
            Sample((x,), {"axes": (0, 2), "keepdims": True}),
            Sample((x,), {"axes": None, "keepdims": False}),
        ]


@defop("sum_to", groups=("reduction",))
class SumTo:
    """Forward: z = sum of x over the axes that broadcasting to x.shape added or stretched,
    giving ``shape``. Backward: gx = broadcast_to(gz, x.shape)."""

    flops = staticmethod(_reduce_flops)

    @staticmethod
    def infer(x: TensorType, *, shape: tuple[int, ...]) -> TensorType:
        if broadcast_shapes(tuple(shape), x.shape) != x.shape:
            raise ShapeError(f"{x} is not a broadcast of {list(shape)}")
        return TensorType(tuple(shape), x.dtype)

    @staticmethod
    def kernel(x: Array, *, shape: tuple[int, ...]) -> Array:
        lead = x.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1
        )
        return np.asarray(np.sum(x, axis=axes, keepdims=True).reshape(shape))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("broadcast_to", c.ct, shape=c.inputs[0].shape),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample((rng.standard_normal((2, 3, 4)),), {"shape": (3, 1)})]
