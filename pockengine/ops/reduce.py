"""Reductions over axes, the sum_to that undoes broadcasting, softmax and log_softmax.

Axes attributes are tuples of ints (negative allowed); None or () is every axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import DType, Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, norm_axes, norm_axis

__all__: list[str] = []


def _reduced_shape(x: TensorType, axes: Sequence[int] | None, keepdims: bool) -> tuple[int, ...]:
    ax = norm_axes(axes, x.rank)
    if keepdims:
        return tuple(1 if i in ax else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in ax)


def _reduce_flops(ins: tuple[TensorType, ...], outs: Any, attrs: Any) -> int:
    return ins[0].numel


@defop("sum", facts=Fact.REDUCTION)
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
        kept = _reduced_shape(x.type, _axes_attr(c), True)
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


@defop("sum_to", facts=Fact.REDUCTION | Fact.VIEW | Fact.SAME_TYPE_IDENTITY)
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


def _axes_attr(c: VJPContext) -> tuple[int, ...] | None:
    axes = c.attrs["axes"]
    if axes is None or (isinstance(axes, tuple) and all(isinstance(a, int) for a in axes)):
        return axes
    raise TypeError(f"{c.node.op}: axes must be a tuple of ints or None, got {axes!r}")


def _axis_attr(c: VJPContext) -> int:
    axis = c.attrs["axis"]
    if isinstance(axis, int):
        return axis
    raise TypeError(f"{c.node.op}: axis must be an int, got {axis!r}")


def _float_input(op: str, x: TensorType) -> TensorType:
    if not x.dtype.is_float:
        raise ShapeError(f"{op} needs a float input, got {x}")
    return x


def _reduce_samples(rng: np.random.Generator) -> list[Sample]:
    x = rng.standard_normal((2, 3, 4))
    return [
        Sample((x,), {"axes": (1,), "keepdims": False}),
        Sample((x,), {"axes": (0, -1), "keepdims": True}),
        Sample((x,), {"axes": None, "keepdims": False}),
    ]


@defop("mean", facts=Fact.REDUCTION)
class Mean:
    """Forward: z = sum(x, axes) / n, n = the number of elements reduced.
    Backward: gx = broadcast_to(reshape(gz, kept) / n, x.shape)."""

    flops = staticmethod(_reduce_flops)
    samples = staticmethod(_reduce_samples)

    @staticmethod
    def infer(x: TensorType, *, axes: tuple[int, ...] | None, keepdims: bool) -> TensorType:
        return TensorType(_reduced_shape(_float_input("mean", x), axes, keepdims), x.dtype)

    @staticmethod
    def kernel(x: Array, *, axes: tuple[int, ...] | None, keepdims: bool) -> Array:
        ax = norm_axes(axes, x.ndim)
        return np.asarray(np.mean(x, axis=ax, keepdims=keepdims), dtype=x.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x = c.inputs[0]
        kept = _reduced_shape(x.type, _axes_attr(c), True)
        count = x.type.numel // max(1, int(np.prod(kept, dtype=np.int64)))
        g = c.call("div", c.call("reshape", c.ct, shape=kept), c.const(float(count), c.ct))
        return (c.call("broadcast_to", g, shape=x.shape),)


@defop("amax", facts=Fact.REDUCTION)
class Amax:
    """Forward: z = max(x, axes). Backward: the gradient is split evenly among the maxima
    (as ATen): m = cast(x == z_kept), gx = m * reshape(gz, kept) / sum(m, axes, keepdims)."""

    flops = staticmethod(_reduce_flops)
    samples = staticmethod(_reduce_samples)

    @staticmethod
    def infer(x: TensorType, *, axes: tuple[int, ...] | None, keepdims: bool) -> TensorType:
        return TensorType(_reduced_shape(x, axes, keepdims), x.dtype)

    @staticmethod
    def kernel(x: Array, *, axes: tuple[int, ...] | None, keepdims: bool) -> Array:
        return np.asarray(np.amax(x, axis=norm_axes(axes, x.ndim), keepdims=keepdims))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, axes = c.inputs[0], _axes_attr(c)
        kept = _reduced_shape(x.type, axes, True)
        z = c.call("reshape", c.out, shape=kept)
        hits = c.call("cast", c.call("eq", x, z), dtype=str(c.ct.dtype))
        count = c.call("sum", hits, axes=axes, keepdims=True)
        share = c.call("div", c.call("reshape", c.ct, shape=kept), count)
        return (c.call("mul", hits, share),)


@defop("any", facts=Fact.REDUCTION)
class AnyOf:
    """Forward: z = any(x != 0, axes), bool. Not differentiable."""

    flops = staticmethod(_reduce_flops)

    @staticmethod
    def infer(x: TensorType, *, axes: tuple[int, ...] | None, keepdims: bool) -> TensorType:
        return TensorType(_reduced_shape(x, axes, keepdims), DType.BOOL)

    @staticmethod
    def kernel(x: Array, *, axes: tuple[int, ...] | None, keepdims: bool) -> Array:
        return np.asarray(np.any(x, axis=norm_axes(axes, x.ndim), keepdims=keepdims))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.random((2, 3, 4)) < 0.2
        return [
            Sample((x,), {"axes": (1,), "keepdims": False}),
            Sample((x,), {"axes": None, "keepdims": True}),
            Sample((rng.integers(0, 2, (3, 4)),), {"axes": (0,), "keepdims": False}),
        ]


def _softmax_infer(op: str) -> Any:
    def infer(x: TensorType, *, axis: int) -> TensorType:
        norm_axis(axis, x.rank)
        return _float_input(op, x)

    return infer


def _softmax_grad_infer(op: str) -> Any:
    """The shape rule of a (log_)softmax backward kernel: gz and the forward output alike."""

    def infer(gz: TensorType, out: TensorType, *, axis: int) -> TensorType:
        norm_axis(axis, out.rank)
        if gz != out:
            raise ShapeError(f"{op} needs gz and the output of one type, got {gz}, {out}")
        return _float_input(op, out)

    return infer


def _softmax_flops(ins: tuple[TensorType, ...], outs: Any, attrs: Any) -> int:
    return 5 * ins[0].numel  # max, subtract, exp, sum, divide (or log and subtract)


def _softmax_samples(rng: np.random.Generator) -> list[Sample]:
    x = rng.standard_normal((2, 3, 4))
    return [Sample((x,), {"axis": -1}), Sample((x,), {"axis": 1})]


def _shifted(x: Array, axis: int) -> Array:
    """x minus its max along axis, so that exp never overflows."""
    return np.asarray(x - np.amax(x, axis=axis, keepdims=True))


@defop("softmax", facts=Fact.REDUCTION)
class Softmax:
    """Forward: z = exp(x - max) / sum(exp(x - max), axis).
    Backward: gx = z * (gz - sum(gz * z, axis, keepdims))."""

    infer = staticmethod(_softmax_infer("softmax"))
    flops = staticmethod(_softmax_flops)
    samples = staticmethod(_softmax_samples)

    @staticmethod
    def kernel(x: Array, *, axis: int) -> Array:
        e = np.exp(_shifted(x, axis))
        return np.asarray(e / np.sum(e, axis=axis, keepdims=True), dtype=x.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("softmax_grad", c.ct, c.out, axis=_axis_attr(c)),)


@defop("safe_softmax", facts=Fact.REDUCTION)
class SafeSoftmax:
    """Forward: softmax(x, axis), except that a slice whose entries are all -inf (a query
    every key of which is masked out) gives zeros instead of NaN (ATen's _safe_softmax,
    what scaled-dot-product attention uses). Backward: gx = softmax_grad(gz, z, axis)."""

    infer = staticmethod(_softmax_infer("safe_softmax"))
    flops = staticmethod(_softmax_flops)

    @staticmethod
    def kernel(x: Array, *, axis: int) -> Array:
        masked = np.all(x == -np.inf, axis=axis, keepdims=True)
        e = np.exp(_shifted(np.where(masked, np.zeros((), x.dtype), x), axis))
        z = np.where(masked, np.zeros((), x.dtype), e / np.sum(e, axis=axis, keepdims=True))
        return np.asarray(z, dtype=x.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("softmax_grad", c.ct, c.out, axis=_axis_attr(c)),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((2, 3, 4))
        masked = x.copy()
        masked[0, 1, :] = -np.inf
        masked[1, 2, 1:] = -np.inf
        return [Sample((x,), {"axis": -1}), Sample((x,), {"axis": 1}),
                Sample((masked,), {"axis": -1})]  # fmt: skip


@defop("softmax_grad", facts=Fact.REDUCTION)
class SoftmaxGrad:
    """Backward kernel of softmax: gx = y * (gz - sum(gz * y, axis, keepdims)) with y the
    softmax output (ATen's _softmax_backward_data)."""

    flops = staticmethod(_softmax_flops)

    infer = staticmethod(_softmax_grad_infer("softmax_grad"))

    @staticmethod
    def kernel(gz: Array, y: Array, *, axis: int) -> Array:
        dot = np.sum(gz * y, axis=axis, keepdims=True)
        return np.asarray(y * (gz - dot), dtype=y.dtype)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        e = np.exp(rng.standard_normal((2, 3, 4)))
        y = e / e.sum(axis=-1, keepdims=True)
        return [Sample((rng.standard_normal((2, 3, 4)), y), {"axis": -1})]


@defop("log_softmax", facts=Fact.REDUCTION)
class LogSoftmax:
    """Forward: z = (x - max) - log(sum(exp(x - max), axis)).
    Backward: gx = log_softmax_grad(gz, z, axis)."""

    infer = staticmethod(_softmax_infer("log_softmax"))
    flops = staticmethod(_softmax_flops)
    samples = staticmethod(_softmax_samples)

    @staticmethod
    def kernel(x: Array, *, axis: int) -> Array:
        s = _shifted(x, axis)
        return np.asarray(s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True)), dtype=x.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("log_softmax_grad", c.ct, c.out, axis=_axis_attr(c)),)


@defop("log_softmax_grad", facts=Fact.REDUCTION)
class LogSoftmaxGrad:
    """Backward kernel of log_softmax: gx = gz - exp(z) * sum(gz, axis, keepdims) with z the
    log_softmax output (ATen's _log_softmax_backward_data: one pass instead of exp, sum, mul
    and sub over, say, an LLM's [tokens, vocab] logits)."""

    flops = staticmethod(_softmax_flops)

    infer = staticmethod(_softmax_grad_infer("log_softmax_grad"))

    @staticmethod
    def kernel(gz: Array, z: Array, *, axis: int) -> Array:
        total = np.sum(gz, axis=axis, keepdims=True)
        return np.asarray(gz - np.exp(z) * total, dtype=z.dtype)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((2, 3, 4))
        z = x - np.log(np.sum(np.exp(x), axis=1, keepdims=True))
        return [Sample((rng.standard_normal((2, 3, 4)), z), {"axis": 1})]


@defop("cumsum", facts=Fact.SCAN)
class Cumsum:
    """Forward: z_i = sum_{j <= i} x_j along ``axis`` (bool sums to i64, as in ATen).
    Backward: gx_i = sum_{j >= i} gz_j = sum(gz) - cumsum(gz)_i + gz_i."""

    flops = staticmethod(_reduce_flops)

    @staticmethod
    def infer(x: TensorType, *, axis: int) -> TensorType:
        norm_axis(axis, x.rank)
        return TensorType(x.shape, DType.I64 if x.dtype is DType.BOOL else x.dtype)

    @staticmethod
    def kernel(x: Array, *, axis: int) -> Array:
        dtype = np.int64 if x.dtype == np.bool_ else x.dtype
        return np.asarray(np.cumsum(x, axis=norm_axis(axis, x.ndim), dtype=dtype))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        axis = _axis_attr(c)
        total = c.call("sum", c.ct, axes=(axis,), keepdims=True)
        head = c.call("sub", total, c.call("cumsum", c.ct, axis=axis))
        return (c.call("add", head, c.ct),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal((3, 5)),), {"axis": 1}),
            Sample((rng.standard_normal((4, 2)),), {"axis": -2}),
        ]
