"""Shape ops: they move or view data and compute nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, norm_axis, same_dtype

_SHAPE = Fact.SHAPE
# Views of their input that are cheap to recompute (a backend may alias them).
_CHEAP_VIEW = Fact.SHAPE | Fact.VIEW | Fact.CHEAP


def _zero_flops(ins: object, outs: object, attrs: object) -> int:
    return 0


@defop("reshape", facts=_CHEAP_VIEW | Fact.SAME_TYPE_IDENTITY)
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


@defop("transpose", facts=_CHEAP_VIEW)
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


@defop(
    "stop_gradient",
    facts=_SHAPE | Fact.ELEMENTWISE | Fact.VIEW | Fact.NO_GRADIENT | Fact.SAME_TYPE_IDENTITY,
)
class StopGradient:
    """Forward: z = x. Backward: none (gx = 0 by definition): no cotangent crosses it, as
    JAX's ``stop_gradient``, TF's ``StopGradient`` and torch's ``detach``. Any dtype."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType) -> TensorType:
        return x

    @staticmethod
    def kernel(x: Array) -> Array:
        return x  # the input itself, as reshape returns a view: kernels never write inputs

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (None,)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal((3, 4)),)),
            Sample((np.asarray(rng.standard_normal()),)),
            Sample((rng.integers(-3, 4, (2, 3)),)),
        ]


@defop("broadcast_to", facts=_CHEAP_VIEW | Fact.SAME_TYPE_IDENTITY)
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


def _int_attr(c: VJPContext, key: str) -> int:
    value = c.attrs[key]
    if not isinstance(value, int):
        raise ShapeError(f"{c.node.op}: attribute {key}={value!r} is not an int")
    return value


def _slice_key(rank: int, axis: int, start: int, stop: int, step: int) -> tuple[slice, ...]:
    key = [slice(None)] * rank
    key[norm_axis(axis, rank)] = slice(start, stop, step)
    return tuple(key)


def _sliced_shape(
    shape: tuple[int, ...], axis: int, start: int, stop: int, step: int
) -> tuple[int, ...]:
    """The shape of ``x[..., start:stop:step, ...]``, after checking the bounds."""
    if not shape:
        raise ShapeError("cannot slice a 0-d tensor")
    ax = norm_axis(axis, len(shape))
    dim = shape[ax]
    if not (0 <= start <= dim and 0 <= stop <= dim):
        raise ShapeError(f"slice {start}:{stop} is not within [0, {dim}] on axis {ax}")
    if step < 1:
        raise ShapeError(f"slice step {step} is not >= 1")
    return (*shape[:ax], len(range(start, stop, step)), *shape[ax + 1 :])


@defop("slice", facts=_CHEAP_VIEW)
class Slice:
    """Forward: z = x[..., start:stop:step, ...] on ``axis``; start and stop are already
    clamped to [0, dim]. Backward: gx = slice_grad(gz, x.shape, axis, start, stop, step)."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *, axis: int, start: int, stop: int, step: int) -> TensorType:
        return TensorType(_sliced_shape(x.shape, axis, start, stop, step), x.dtype)

    @staticmethod
    def kernel(x: Array, *, axis: int, start: int, stop: int, step: int) -> Array:
        return x[_slice_key(x.ndim, axis, start, stop, step)]

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("slice_grad", c.ct, shape=c.inputs[0].shape, **c.attrs),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((4, 6, 5))
        return [
            Sample((x,), {"axis": 1, "start": 1, "stop": 6, "step": 2}),
            Sample((x,), {"axis": -1, "start": 0, "stop": 3, "step": 1}),
            Sample((x,), {"axis": 0, "start": 2, "stop": 2, "step": 1}),
        ]


@defop("slice_grad", facts=_SHAPE)
class SliceGrad:
    """Forward: z = zeros(shape); z[..., start:stop:step, ...] = gz on ``axis``.
    Backward (it is linear): ggz = slice(gz', axis, start, stop, step)."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(
        gz: TensorType, *, shape: tuple[int, ...], axis: int, start: int, stop: int, step: int
    ) -> TensorType:
        expected = _sliced_shape(tuple(shape), axis, start, stop, step)
        if gz.shape != expected:
            raise ShapeError(f"{gz} is not the shape {list(expected)} of the slice")
        return TensorType(tuple(shape), gz.dtype)

    @staticmethod
    def kernel(
        gz: Array, *, shape: tuple[int, ...], axis: int, start: int, stop: int, step: int
    ) -> Array:
        out = np.zeros(shape, dtype=gz.dtype)
        out[_slice_key(out.ndim, axis, start, stop, step)] = gz
        return out

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        attrs = {k: v for k, v in c.attrs.items() if k != "shape"}
        return (c.call("slice", c.ct, **attrs),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        attrs = {"shape": (4, 6, 5), "axis": 1, "start": 1, "stop": 6, "step": 2}
        return [Sample((rng.standard_normal((4, 3, 5)),), attrs)]


@defop("concat", facts=_SHAPE)
class Concat:
    """Forward: z = concatenate(x0, x1, ..., axis). Backward: gxi = slice(gz, axis, oi, oi + ni)
    with oi the offset of xi along ``axis`` and ni its size."""

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(*xs: TensorType, axis: int) -> TensorType:
        if not xs:
            raise ShapeError("concat needs at least one input")
        dtype = same_dtype("concat", *xs)
        rank = xs[0].rank
        if rank == 0 or any(x.rank != rank for x in xs):
            raise ShapeError(f"concat needs inputs of one rank >= 1, got {[str(x) for x in xs]}")
        ax = norm_axis(axis, rank)
        rest = {x.shape[:ax] + x.shape[ax + 1 :] for x in xs}
        if len(rest) != 1:
            raise ShapeError(f"concat inputs differ off axis {ax}: {[str(x) for x in xs]}")
        size = sum(x.shape[ax] for x in xs)
        return TensorType((*xs[0].shape[:ax], size, *xs[0].shape[ax + 1 :]), dtype)

    @staticmethod
    def kernel(*xs: Array, axis: int) -> Array:
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        ax = norm_axis(_int_attr(c, "axis"), c.out.type.rank)
        grads: list[Value | None] = []
        offset = 0
        for x, need in zip(c.inputs, c.needs, strict=True):
            size = x.shape[ax]
            stop = offset + size
            grads.append(
                c.call("slice", c.ct, axis=ax, start=offset, stop=stop, step=1) if need else None
            )
            offset = stop
        return grads

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        a, b, c = (rng.standard_normal((2, n, 3)) for n in (1, 4, 2))
        return [
            Sample((a, b, c), {"axis": 1}),
            Sample((a.reshape(2, 3), b.reshape(8, 3)), {"axis": -2}),
        ]


def _check_pads(x: TensorType, pads: tuple[tuple[int, int], ...]) -> None:
    if len(pads) != x.rank:
        raise ShapeError(f"pad needs one (before, after) pair per axis of {x}, got {pads}")
    for pair in pads:
        if len(pair) != 2 or any(not isinstance(p, int) or p < 0 for p in pair):
            raise ShapeError(f"pad amounts must be pairs of ints >= 0, got {pads}")


@defop("pad", facts=_SHAPE)
class Pad:
    """Constant padding, pads = ((before0, after0), (before1, after1), ...), one pair per axis.

    Forward: z = value outside, z[b0:b0+n0, b1:b1+n1, ...] = x. Backward: gx = that crop of
    gz, a chain of slices over the padded axes.
    """

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *, pads: tuple[tuple[int, int], ...], value: float) -> TensorType:
        _check_pads(x, pads)
        shape = tuple(d + b + a for d, (b, a) in zip(x.shape, pads, strict=True))
        return TensorType(shape, x.dtype)

    @staticmethod
    def kernel(x: Array, *, pads: tuple[tuple[int, int], ...], value: float) -> Array:
        if x.ndim == 0:
            return x.copy()
        return np.pad(x, pads, mode="constant", constant_values=value)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        pads = c.attrs["pads"]
        assert isinstance(pads, tuple)
        g = c.ct
        for axis, ((before, after), dim) in enumerate(zip(pads, c.inputs[0].shape, strict=True)):
            if before or after:
                g = c.call("slice", g, axis=axis, start=before, stop=before + dim, step=1)
        return (g,)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((2, 3, 4))
        return [
            Sample((x,), {"pads": ((0, 0), (1, 2), (3, 0)), "value": 0.0}),
            Sample((x,), {"pads": ((1, 1), (0, 0), (0, 0)), "value": -1.5}),
        ]
