"""Convolution on channel-blocked activations: ``conv2d_nchwc`` and its two backward kernels.

The same convolutions as ``nn.py``'s (OIHW weights, the same geometry attributes), with
the input, output and their gradients laid out NCHW{c}c (``ops/layout.py``: [N,
ceil(C/c), H, W, c], the last block padded with zeros; ``block`` is c). Only a layout
pass makes them (the C backend's ``backends/c/layout.py``, between ``layout_convert``
nodes); the reference kernels convert to NCHW and call ``nn.py``'s. A blocked result's
padded channels are zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop, get_op
from pockengine.ir.arrays import Array
from pockengine.ops._window import Pair
from pockengine.ops.layout import from_nchw, logical_shape, shape_in, to_nchw

__all__: list[str] = []

_GEOMETRY = ("stride", "padding", "dilation", "groups")


def _layout(block: object) -> str:
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ShapeError(f"a channel-blocked convolution's block is an int >= 2, got {block!r}")
    return f"NCHW{block}c"


def _nchw(t: TensorType, block: object, channels: int) -> TensorType:
    return TensorType(logical_shape(_layout(block), t.shape, channels), t.dtype)


def _blocked(t: TensorType, block: object) -> TensorType:
    if len(t.shape) != 4:
        raise ShapeError(f"a convolution's activation has rank 4, got shape {list(t.shape)}")
    return TensorType(shape_in(_layout(block), *t.shape), t.dtype)


def _one(t: TensorType | tuple[TensorType, ...]) -> TensorType:
    assert isinstance(t, TensorType), t
    return t


def _in_channels(w: TensorType | Array, groups: Any) -> int:
    return int(w.shape[1]) * int(groups)


def _flops(gy_nchw: tuple[int, ...], w_shape: tuple[int, ...]) -> int:
    return 2 * int(np.prod(gy_nchw, dtype=np.int64)) * int(np.prod(w_shape[1:], dtype=np.int64))


def _geometry(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: attrs[k] for k in _GEOMETRY}


# (x NCHW shape, w shape, stride, padding, groups, block): depthwise at strides 1 and 2
# (6 channels in blocks of 4: a padded last block), a dense 3x3 and a pointwise one
_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...], Pair, Pair, int, int], ...] = (
    ((2, 6, 5, 6), (6, 1, 3, 3), (1, 1), (1, 1), 6, 4),
    ((1, 3, 7, 6), (3, 1, 3, 3), (2, 2), (1, 1), 3, 2),
    ((2, 5, 3, 4), (6, 5, 3, 3), (1, 1), (1, 1), 1, 4),
    ((2, 5, 3, 4), (6, 5, 1, 1), (1, 1), (0, 0), 1, 8),
)


def _samples(rng: np.random.Generator, which: str) -> list[Sample]:
    out = []
    for xs, ws, stride, padding, groups, block in _CASES:
        attrs: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": (1, 1)}
        attrs |= {"groups": groups, "block": block}
        layout = _layout(block)
        x = from_nchw(rng.standard_normal(xs), layout)
        w = rng.standard_normal(ws)
        if which == "forward":
            out.append(Sample((x, w, rng.standard_normal(ws[0])), attrs))
            continue
        y = Conv2dNchwc.kernel(x, w, **attrs)
        gy = from_nchw(to_nchw(np.asarray(rng.standard_normal(y.shape)), layout, ws[0]), layout)
        if which == "input":
            out.append(Sample((gy, w), {"x_shape": xs, **attrs}))
        else:
            out.append(Sample((x, gy), {"w_shape": ws, **attrs}))
    return out


@defop("conv2d_nchwc")
class Conv2dNchwc:
    """conv2d on NCHW{block}c activations: x [N, ceil(C/block), H, W, block], w OIHW,
    optional bias (O,), y [N, ceil(O/block), H_out, W_out, block]; attributes as conv2d's
    and ``block``.

    Forward: y = blocked(conv2d(nchw(x), w, b)).
    Backward: gx = conv2d_nchwc_input_grad(gy, w), gw = conv2d_nchwc_weight_grad(x, gy),
    gb = sum over the channels of nchw(gy) (conversion, then a sum).
    """

    @staticmethod
    def infer(
        x: TensorType, w: TensorType, b: TensorType | None = None, **attrs: Any
    ) -> TensorType:
        block, geometry = attrs["block"], _geometry(attrs)
        xn = _nchw(x, block, _in_channels(w, attrs["groups"]))
        args = (xn, w) if b is None else (xn, w, b)
        return _blocked(_one(get_op("conv2d").infer(*args, **geometry)), block)

    @staticmethod
    def kernel(x: Array, w: Array, b: Array | None = None, **attrs: Any) -> Array:
        layout = _layout(attrs["block"])
        xn = to_nchw(x, layout, _in_channels(w, attrs["groups"]))
        args = (xn, w) if b is None else (xn, w, b)
        y = get_op("conv2d").kernel(*args, **_geometry(attrs))
        return np.ascontiguousarray(from_nchw(y, layout))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        w = ins[1].shape
        y = logical_shape(_layout(attrs["block"]), outs[0].shape, w[0])
        return _flops(y, w) + (int(np.prod(y)) if len(ins) == 3 else 0)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w = c.inputs[:2]
        attrs = {**_geometry(dict(c.attrs)), "block": c.attrs["block"]}
        layout = _layout(c.attrs["block"])
        x_nchw = logical_shape(layout, x.shape, _in_channels(w.type, c.attrs["groups"]))
        grads = [
            c.call("conv2d_nchwc_input_grad", c.ct, w, x_shape=x_nchw, **attrs)
            if c.needs[0]
            else None,
            c.call("conv2d_nchwc_weight_grad", x, c.ct, w_shape=w.shape, **attrs)
            if c.needs[1]
            else None,
        ]
        if len(c.inputs) == 3:
            if c.needs[2]:
                gy = c.call("layout_convert", c.ct, src=layout, dst="NCHW", channels=w.shape[0])
                grads.append(c.call("sum", gy, axes=(0, 2, 3), keepdims=False))
            else:
                grads.append(None)
        return grads

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "forward")


@defop("conv2d_nchwc_input_grad")
class Conv2dNchwcInputGrad:
    """conv2d_input_grad on NCHW{block}c activations: gy [N, ceil(O/block), H_out, W_out,
    block], w OIHW, gx laid out NCHW{block}c for the NCHW shape ``x_shape``.

    Forward: gx = blocked(conv2d_input_grad(nchw(gy), w, x_shape)).
    Backward: ggy = conv2d_nchwc(gx_ct, w), gw = conv2d_nchwc_weight_grad(gx_ct, gy).
    """

    @staticmethod
    def infer(
        gy: TensorType, w: TensorType, *, x_shape: tuple[int, ...], **attrs: Any
    ) -> TensorType:
        block, geometry = attrs["block"], _geometry(attrs)
        gyn = _nchw(gy, block, w.shape[0])
        t = get_op("conv2d_input_grad").infer(gyn, w, x_shape=tuple(x_shape), **geometry)
        return _blocked(_one(t), block)

    @staticmethod
    def kernel(gy: Array, w: Array, *, x_shape: tuple[int, ...], **attrs: Any) -> Array:
        layout = _layout(attrs["block"])
        kernel = get_op("conv2d_input_grad").kernel
        gyn = to_nchw(gy, layout, w.shape[0])
        gx = kernel(gyn, w, x_shape=tuple(x_shape), **_geometry(attrs))
        return np.ascontiguousarray(from_nchw(gx, layout))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        w = ins[1].shape
        return _flops(logical_shape(_layout(attrs["block"]), ins[0].shape, w[0]), w)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        gy, w = c.inputs
        attrs = {**_geometry(dict(c.attrs)), "block": c.attrs["block"]}
        return [
            c.call("conv2d_nchwc", c.ct, w, **attrs) if c.needs[0] else None,
            c.call("conv2d_nchwc_weight_grad", c.ct, gy, w_shape=w.shape, **attrs)
            if c.needs[1]
            else None,
        ]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "input")


@defop("conv2d_nchwc_weight_grad")
class Conv2dNchwcWeightGrad:
    """conv2d_weight_grad on NCHW{block}c activations: x [N, ceil(C/block), H, W, block],
    gy [N, ceil(O/block), H_out, W_out, block], gw of shape ``w_shape`` (OIHW).

    Forward: gw = conv2d_weight_grad(nchw(x), nchw(gy)).
    Backward: none (a backward kernel).
    """

    @staticmethod
    def infer(
        x: TensorType, gy: TensorType, *, w_shape: tuple[int, ...], **attrs: Any
    ) -> TensorType:
        block, geometry = attrs["block"], _geometry(attrs)
        xn = _nchw(x, block, _in_channels(TensorType(tuple(w_shape), x.dtype), attrs["groups"]))
        gyn = _nchw(gy, block, w_shape[0])
        return _one(get_op("conv2d_weight_grad").infer(xn, gyn, w_shape=tuple(w_shape), **geometry))

    @staticmethod
    def kernel(x: Array, gy: Array, *, w_shape: tuple[int, ...], **attrs: Any) -> Array:
        layout = _layout(attrs["block"])
        xn = to_nchw(x, layout, int(w_shape[1]) * int(attrs["groups"]))
        gyn = to_nchw(gy, layout, w_shape[0])
        kernel = get_op("conv2d_weight_grad").kernel
        return np.asarray(kernel(xn, gyn, w_shape=tuple(w_shape), **_geometry(attrs)))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        w = outs[0].shape
        return _flops(logical_shape(_layout(attrs["block"]), ins[1].shape, w[0]), w)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(rng, "weight")
