"""Shape ops: they move or view data and compute nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ops._common import Array, broadcast_shapes

__all__: list[str] = []

_SHAPE = ("shape",)


def _zero_flops(ins: object, outs: object, attrs: object) -> int:
    return 0


@defop("reshape", groups=_SHAPE)
class Reshape:
    """Forward: z = reshape(x, shape). Backward: gx = reshape(gz, x.shape)."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *, shape: tuple[int, ...]) -> TensorType:
        if int(np.prod(shape, dtype=np.int64)) != x.numel or any(d < 0 for d in shape):
            raise ShapeError(f"cannot reshape {x} to {list(shape)}")
        return TensorType(tuple(shape), x.dtype)

    @staticmethod
    def kernel(x: Array, *, shape: tuple[int, ...]) -> Array:
        return x.reshape(shape)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("reshape", c.ct, shape=c.inputs[0].shape),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample((rng.standard_normal((2, 6)),), {"shape": (3, 2, 2)})]


@defop("transpose", groups=_SHAPE)
class Transpose:
    """Forward: z = permute(x, perm). Backward: gx = permute(gz, argsort(perm))."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *, perm: tuple[int, ...]) -> TensorType:
        if sorted(perm) != list(range(x.rank)):
            raise ShapeError(f"perm {list(perm)} is not a permutation of {x.rank} axes")
        return TensorType(tuple(x.shape[p] for p in perm), x.dtype)

    @staticmethod
    def kernel(x: Array, *, perm: tuple[int, ...]) -> Array:
        return np.transpose(x, perm)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        inverse = tuple(int(i) for i in np.argsort(c.attrs["perm"]))  # type: ignore[arg-type]
        return (c.call("transpose", c.ct, perm=inverse),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample((rng.standard_normal((2, 3, 4)),), {"perm": (2, 0, 1)})]


@defop("broadcast_to", groups=_SHAPE)
class BroadcastTo:
    """Forward: z = broadcast_to(x, shape). Backward: gx = gz (autodiff sums it to x.shape)."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *, shape: tuple[int, ...]) -> TensorType:
        if broadcast_shapes(x.shape, tuple(shape)) != tuple(shape):
            raise ShapeError(f"cannot broadcast {x} to {list(shape)}")
        return TensorType(tuple(shape), x.dtype)

    @staticmethod
    def kernel(x: Array, *, shape: tuple[int, ...]) -> Array:
        return np.broadcast_to(x, shape)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.ct,)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [Sample((rng.standard_normal((3, 1)),), {"shape": (2, 3, 4)})]
