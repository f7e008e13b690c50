"""Convolution on channels-last activations: ``conv2d_nhwc`` and its two backward kernels.

The same convolutions as ``nn.py``'s (OIHW weights, the same geometry attributes), with
the input, output and their gradients laid out NHWC ([N, H, W, C]). Only a layout pass
makes them (the C backend's ``backends/c/layout.py``, between ``layout_convert`` nodes);
the reference kernels transpose to NCHW and call ``nn.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop, get_op
from pockengine.ir.arrays import Array
from pockengine.ops._window import Pair

__all__: list[str] = []

_GEOMETRY = ("stride", "padding", "dilation", "groups")
_TO_NCHW = (0, 3, 1, 2)
_TO_NHWC = (0, 2, 3, 1)


def _nchw(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != 4:
        raise ShapeError(f"an NHWC activation has rank 4, got shape {list(shape)}")
    return tuple(shape[p] for p in _TO_NCHW)


def _nhwc(t: TensorType) -> TensorType:
    return TensorType(tuple(t.shape[p] for p in _TO_NHWC), t.dtype)


def _one(t: TensorType | tuple[TensorType, ...]) -> TensorType:
    assert isinstance(t, TensorType), t
    return t


def _as_nchw(t: TensorType) -> TensorType:
    return TensorType(_nchw(t.shape), t.dtype)


def _flops(gy: TensorType, w_shape: tuple[int, ...]) -> int:
    return 2 * gy.numel * int(np.prod(w_shape[1:], dtype=np.int64))


# (x NCHW shape, w shape, stride, padding, groups): depthwise at strides 1 and 2, pointwise
_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...], Pair, Pair, int], ...] = (
    ((2, 4, 5, 6), (4, 1, 3, 3), (1, 1), (1, 1), 4),
    ((1, 3, 7, 6), (3, 1, 3, 3), (2, 2), (1, 1), 3),
    ((2, 5, 3, 4), (6, 5, 1, 1), (1, 1), (0, 0), 1),
)


def _samples(rng: np.random.Generator, which: str) -> list[Sample]:
    out = []
    for xs, ws, stride, padding, groups in _CASES:
        attrs: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": (1, 1)}
        attrs["groups"] = groups
        x = rng.standard_normal(tuple(xs[p] for p in _TO_NHWC))
        w = rng.standard_normal(ws)
        if which == "forward":
            out.append(Sample((x, w, rng.standard_normal(ws[0])), attrs))
            continue
        y = Conv2dNhwc.kernel(x, w, **attrs)
        gy = np.asarray(rng.standard_normal(y.shape))
        if which == "input":
            out.append(Sample((gy, w), {"x_shape": x.shape, **attrs}))
        else:
            out.append(Sample((x, gy), {"w_shape": w.shape, **attrs}))
    return out


@defop("conv2d_nhwc")
class Conv2dNhwc:
    """conv2d on NHWC activations: x [N, H, W, C], w OIHW, optional bias (O,), y
    [N, H_out, W_out, O]; attributes as conv2d's.

    Forward: y = transpose(conv2d(transpose(x, NCHW), w, b), NHWC).
    Backward: gx = conv2d_nhwc_input_grad(gy, w), gw = conv2d_nhwc_weight_grad(x, gy),
    gb = sum(gy, axes=(0, 1, 2)).
    """

    @staticmethod
    def infer(
        x: TensorType, w: TensorType, b: TensorType | None = None, **attrs: object
    ) -> TensorType:
        args = (_as_nchw(x), w) if b is None else (_as_nchw(x), w, b)
        return _nhwc(_one(get_op("conv2d").infer(*args, **attrs)))

    @staticmethod
    def kernel(x: Array, w: Array, b: Array | None = None, **attrs: object) -> Array:
        args = (np.transpose(x, _TO_NCHW), w) if b is None else (np.transpose(x, _TO_NCHW), w, b)
        y = get_op("conv2d").kernel(*args, **attrs)
        return np.ascontiguousarray(np.transpose(y, _TO_NHWC))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return _flops(outs[0], ins[1].shape) + (outs[0].numel if len(ins) == 3 else 0)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w = c.inputs[:2]
        geometry = {k: c.attrs[k] for k in _GEOMETRY}
        grads = [
            c.call("conv2d_nhwc_input_grad", c.ct, w, x_shape=x.shape, **geometry)
            if c.needs[0]
            else None,
            c.call("conv2d_nhwc_weight_grad", x, c.ct, w_shape=w.shape, **geometry)
            if c.needs[1]
            else None,
        ]
        if len(c.inputs) == 3:
            needs_b = c.needs[2]
            grads.append(c.call("sum", c.ct, axes=(0, 1, 2), keepdims=False) if needs_b else None)
        return grads

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "forward")


@defop("conv2d_nhwc_input_grad")
class Conv2dNhwcInputGrad:
    """conv2d_input_grad on NHWC activations: gy [N, H_out, W_out, O], w OIHW, gx of
    shape ``x_shape`` (NHWC).

    Forward: gx = transpose(conv2d_input_grad(transpose(gy, NCHW), w), NHWC).
    Backward: ggy = conv2d_nhwc(gx_ct, w), gw = conv2d_nhwc_weight_grad(gx_ct, gy).
    """

    @staticmethod
    def infer(
        gy: TensorType, w: TensorType, *, x_shape: tuple[int, ...], **attrs: object
    ) -> TensorType:
        t = get_op("conv2d_input_grad").infer(_as_nchw(gy), w, x_shape=_nchw(x_shape), **attrs)
        return _nhwc(_one(t))

    @staticmethod
    def kernel(gy: Array, w: Array, *, x_shape: tuple[int, ...], **attrs: object) -> Array:
        kernel = get_op("conv2d_input_grad").kernel
        gx = kernel(np.transpose(gy, _TO_NCHW), w, x_shape=_nchw(x_shape), **attrs)
        return np.ascontiguousarray(np.transpose(gx, _TO_NHWC))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return _flops(ins[0], ins[1].shape)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        gy, w = c.inputs
        geometry = {k: c.attrs[k] for k in _GEOMETRY}
        return [
            c.call("conv2d_nhwc", c.ct, w, **geometry) if c.needs[0] else None,
            c.call("conv2d_nhwc_weight_grad", c.ct, gy, w_shape=w.shape, **geometry)
            if c.needs[1]
            else None,
        ]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "input")


@defop("conv2d_nhwc_weight_grad")
class Conv2dNhwcWeightGrad:
    """conv2d_weight_grad on NHWC activations: x [N, H, W, C], gy [N, H_out, W_out, O],
    gw of shape ``w_shape`` (OIHW).

    Forward: gw = conv2d_weight_grad(transpose(x, NCHW), transpose(gy, NCHW)).
    Backward: none (a backward kernel).
    """

    @staticmethod
    def infer(x: TensorType, gy: TensorType, **attrs: object) -> TensorType:
        return _one(get_op("conv2d_weight_grad").infer(_as_nchw(x), _as_nchw(gy), **attrs))

    @staticmethod
    def kernel(x: Array, gy: Array, **attrs: object) -> Array:
        kernel = get_op("conv2d_weight_grad").kernel
        return np.asarray(kernel(np.transpose(x, _TO_NCHW), np.transpose(gy, _TO_NCHW), **attrs))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return _flops(ins[1], outs[0].shape)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "weight")
