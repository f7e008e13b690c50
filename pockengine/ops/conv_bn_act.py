"""A convolution whose input is hardtanh(batch_norm(x)), and its weight gradient, as ops.

``conv2d_bn_hardtanh(x, bw, bb, w[, bias])`` is ``conv2d(z, w, bias)`` with ``(z, mean,
var) = batch_norm_hardtanh(x, bw, bb)``; its results are the convolution's output and
batch norm's statistics, so ``z`` is never stored.
``conv2d_bn_hardtanh_weight_grad(x, bw, bb, mean, var, gy)`` is ``conv2d_weight_grad(z,
gy)`` with ``z = batch_norm_apply(x, bw, bb, mean, var)`` (clipped): the weight gradient
of that convolution reading ``x`` and the statistics the forward pass saved. The C backend
rewrites MobileNet-style chains (batch norm, relu6, a depthwise convolution) into these
after autodiff (``backends/c/fuse_dw_bn.py``). The NumPy kernels are the unfused
definitions.
"""

from __future__ import annotations

import numpy as np

from pockengine.ir import Sample, TensorType, defop
from pockengine.ir.arrays import Array
from pockengine.ops._window import Pair
from pockengine.ops.nn import Conv2d, Conv2dWeightGrad
from pockengine.ops.norm import BatchNorm
from pockengine.ops.norm_act import BatchNormApply, BatchNormHardtanh

__all__: list[str] = []

# (x shape, stride): depthwise 3x3 with padding 1 over 3 channels, with and without stride
_CASES = (((2, 3, 5, 5), (1, 1)), ((2, 3, 6, 7), (2, 2)))


def _geometry(stride: Pair, channels: int) -> dict[str, object]:
    return {"stride": stride, "padding": (1, 1), "dilation": (1, 1), "groups": channels}


def _bn_inputs(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[Array, Array, Array]:
    """(x, bw, bb) whose normalised values fall on both sides of the bounds 0 and 1."""
    x = rng.standard_normal(shape)
    return x, rng.standard_normal(shape[1]), rng.standard_normal(shape[1])


@defop("conv2d_bn_hardtanh")
class Conv2dBnHardtanh:
    """conv2d of hardtanh(batch_norm(x)): inputs x, bw, bb (batch norm's weight and bias),
    w and an optional conv bias; attributes eps, min_val, max_val and conv2d's geometry;
    results y, mean and the biased variance.

    Forward: (z, mean, var) = batch_norm_hardtanh(x, bw, bb); y = conv2d(z, w, bias).
    Made after autodiff (the C backend's rewrite), so it has no VJP.
    """

    @staticmethod
    def infer(
        x: TensorType,
        bw: TensorType,
        bb: TensorType,
        w: TensorType,
        bias: TensorType | None = None,
        *,
        eps: float,
        min_val: float,
        max_val: float,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> tuple[TensorType, ...]:
        _, mean, var = BatchNormHardtanh.infer(x, bw, bb, eps=eps, min_val=min_val, max_val=max_val)
        geometry = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
        return Conv2d.infer(x, w, bias, **geometry), mean, var  # type: ignore[arg-type]

    @staticmethod
    def kernel(
        x: Array,
        bw: Array,
        bb: Array,
        w: Array,
        bias: Array | None = None,
        *,
        eps: float,
        min_val: float,
        max_val: float,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> tuple[Array, Array, Array]:
        z, mean, var = BatchNormHardtanh.kernel(
            x, bw, bb, eps=eps, min_val=min_val, max_val=max_val
        )
        y = Conv2d.kernel(
            z, w, bias, stride=stride, padding=padding, dilation=dilation, groups=groups
        )
        return y, mean, var

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        conv = 2 * outs[0].numel * ins[3].numel // ins[3].shape[0]
        return 9 * ins[0].numel + conv

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for (shape, stride), bias in zip(_CASES, (True, False), strict=True):
            x, bw, bb = _bn_inputs(rng, shape)
            w = rng.standard_normal((shape[1], 1, 3, 3))
            ins = (x, bw, bb, w, rng.standard_normal(shape[1])) if bias else (x, bw, bb, w)
            attrs = {"eps": 1e-5, "min_val": 0.0, "max_val": 1.0, **_geometry(stride, shape[1])}
            out.append(Sample(ins, attrs))
        return out


@defop("conv2d_bn_hardtanh_weight_grad")
class Conv2dBnHardtanhWeightGrad:
    """conv2d_weight_grad of hardtanh(batch_norm(x)) from saved statistics: inputs x, bw,
    bb, mean, var and gy; attributes eps, min_val, max_val, w_shape and conv2d's geometry.

    Forward: z = batch_norm_apply(x, bw, bb, mean, var, min_val, max_val);
    gw = conv2d_weight_grad(z, gy).
    Backward: none (a backward kernel).
    """

    @staticmethod
    def infer(
        x: TensorType,
        bw: TensorType,
        bb: TensorType,
        mean: TensorType,
        var: TensorType,
        gy: TensorType,
        *,
        eps: float,
        min_val: float,
        max_val: float,
        w_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> TensorType:
        BatchNormApply.infer(x, bw, bb, mean, var, eps=eps, min_val=min_val, max_val=max_val)
        return Conv2dWeightGrad.infer(
            x, gy, w_shape=w_shape, stride=stride, padding=padding, dilation=dilation,
            groups=groups,
        )  # fmt: skip

    @staticmethod
    def kernel(
        x: Array,
        bw: Array,
        bb: Array,
        mean: Array,
        var: Array,
        gy: Array,
        *,
        eps: float,
        min_val: float,
        max_val: float,
        w_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> Array:
        z = BatchNormApply.kernel(x, bw, bb, mean, var, eps=eps, min_val=min_val, max_val=max_val)
        return Conv2dWeightGrad.kernel(
            z, gy, w_shape=w_shape, stride=stride, padding=padding, dilation=dilation,
            groups=groups,
        )  # fmt: skip

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 4 * ins[0].numel + 2 * ins[5].numel * outs[0].numel // outs[0].shape[0]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for shape, stride in _CASES:
            x, bw, bb = _bn_inputs(rng, shape)
            _, mean, var = BatchNorm.kernel(x, bw, bb, eps=1e-5)
            geometry = _geometry(stride, shape[1])
            w_shape = (shape[1], 1, 3, 3)
            y_shape = Conv2d.kernel(x, np.zeros(w_shape), **geometry).shape  # type: ignore[arg-type]
            gy = np.asarray(rng.standard_normal(y_shape))
            attrs = {"eps": 1e-5, "min_val": 0.0, "max_val": 1.0, "w_shape": w_shape, **geometry}
            out.append(Sample((x, bw, bb, mean, var, gy), attrs))
        return out
