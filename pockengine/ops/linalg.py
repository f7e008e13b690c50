"""Matrix products."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, same_dtype

__all__: list[str] = []


def _swap_last(v: Value, c: VJPContext) -> Value:
    perm = (*range(v.type.rank - 2), v.type.rank - 1, v.type.rank - 2)
    return c.call("transpose", v, perm=perm)


@defop("matmul")
class Matmul:
    """Batched matrix product of rank >= 2 operands; batch axes broadcast.

    Forward: z = x @ y. Backward: gx = gz @ y^T, gy = x^T @ gz (summed over broadcast
    batch axes by autodiff).
    """

    @staticmethod
    def infer(x: TensorType, y: TensorType) -> TensorType:
        dtype = same_dtype("matmul", x, y)
        if x.rank < 2 or y.rank < 2:
            raise ShapeError("matmul needs operands of rank >= 2")
        if x.shape[-1] != y.shape[-2]:
            raise ShapeError(f"inner sizes differ: {x} @ {y}")
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
        return TensorType((*batch, x.shape[-2], y.shape[-1]), dtype)

    @staticmethod
    def kernel(x: Array, y: Array) -> Array:
        return np.asarray(np.matmul(x, y))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 2 * outs[0].numel * ins[0].shape[-1]

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, y = c.inputs
        gx = c.call("matmul", c.ct, _swap_last(y, c)) if c.needs[0] else None
        gy = c.call("matmul", _swap_last(x, c), c.ct) if c.needs[1] else None
        return (gx, gy)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal((3, 4)), rng.standard_normal((4, 5)))),
            Sample((rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 2)))),
        ]


@defop("linear")
class Linear:
    """Fused forward kernel: z = x @ w + b, with x of rank >= 2, w a matrix and b a vector
    over the last axis (what ``fuse_linear_bias`` makes of a matmul whose only reader adds
    a bias; autodiff has already run, so it needs no VJP)."""

    @staticmethod
    def infer(x: TensorType, w: TensorType, b: TensorType) -> TensorType:
        dtype = same_dtype("linear", x, w, b)
        if x.rank < 2 or w.rank != 2 or b.shape != (w.shape[1],):
            raise ShapeError(f"linear needs x (rank >= 2), w [k, n] and b [n], got {x}, {w}, {b}")
        if x.shape[-1] != w.shape[0]:
            raise ShapeError(f"inner sizes differ: {x} @ {w}")
        return TensorType((*x.shape[:-1], w.shape[1]), dtype)

    @staticmethod
    def kernel(x: Array, w: Array, b: Array) -> Array:
        return np.asarray(np.matmul(x, w) + b)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 2 * outs[0].numel * ins[0].shape[-1] + outs[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        r = rng.standard_normal
        return [Sample((r((3, 4)), r((4, 5)), r(5))), Sample((r((2, 3, 4)), r((4, 2)), r(2)))]
