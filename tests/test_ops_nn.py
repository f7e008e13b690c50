"""The NumPy kernels of the neural-network ops against PyTorch, in float64.

Every forward kernel is compared with torch.nn.functional, and every backward
kernel with torch.autograd.grad of the same forward on a random cotangent.
The op table test checks the VJP rules; this one checks the semantics.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pockengine.ops  # noqa: F401  (registers the ops)
from pockengine.ir import Attrs, DType, ShapeError, TensorType, get_op

Array = np.ndarray[Any, Any]


def _run(op: str, *arrays: Array, **attrs: Any) -> tuple[Array, ...]:
    """Run an op's kernel after checking its shape rule agrees with the result."""
    opdef = get_op(op)
    frozen = Attrs(attrs)
    types = opdef.infer_types(
        [TensorType(a.shape, DType.from_numpy(a.dtype)) for a in arrays], frozen
    )
    outs = opdef.run(arrays, frozen)
    assert tuple(o.shape for o in outs) == tuple(t.shape for t in types), op
    return outs


def _t(a: Array, grad: bool = False) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def _close(got: Array, want: torch.Tensor) -> None:
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-10)


# -- conv2d -------------------------------------------------------------------

# (x shape, w shape, stride, padding, dilation, groups)
CONV_CASES = {
    "same3x3": ((2, 3, 6, 7), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    "stride2_uncovered": ((2, 3, 8, 9), (4, 3, 3, 3), (2, 2), (1, 0), (1, 1), 1),
    "stride3_uncovered": ((1, 2, 10, 11), (3, 2, 2, 3), (3, 3), (0, 1), (1, 1), 1),
    "asymmetric": ((2, 2, 7, 9), (3, 2, 3, 1), (2, 1), (0, 2), (1, 1), 1),
    "dilated": ((1, 2, 9, 8), (3, 2, 3, 2), (1, 1), (2, 1), (2, 3), 1),
    "dilated_stride": ((2, 3, 11, 10), (2, 3, 3, 3), (2, 3), (1, 2), (2, 2), 1),
    "groups2": ((2, 4, 5, 5), (6, 2, 2, 2), (2, 1), (0, 1), (1, 1), 2),
    "groups3_wide": ((1, 6, 6, 6), (9, 2, 3, 3), (1, 1), (1, 1), (1, 1), 3),
    "depthwise": ((2, 4, 7, 6), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4),
    "depthwise_stride2": ((2, 4, 7, 6), (4, 1, 3, 3), (2, 2), (1, 1), (1, 1), 4),
    "depthwise_mult2": ((1, 3, 5, 5), (6, 1, 3, 2), (1, 2), (1, 0), (1, 1), 3),
    "depthwise_dilated": ((2, 3, 9, 9), (3, 1, 3, 3), (2, 2), (2, 2), (2, 2), 3),
    "single_channel": ((2, 1, 6, 6), (2, 1, 3, 3), (1, 1), (0, 0), (1, 1), 1),
    "pointwise": ((2, 5, 4, 3), (3, 5, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    "pointwise_stride2": ((2, 5, 5, 4), (3, 5, 1, 1), (2, 2), (0, 0), (1, 1), 1),
    "kernel_is_input": ((2, 3, 4, 4), (5, 3, 4, 4), (1, 1), (0, 0), (1, 1), 1),
    "padding_over_kernel": ((1, 2, 3, 4), (3, 2, 3, 2), (2, 3), (3, 2), (1, 1), 1),
    # A MobileNetV2 inverted residual (t=6): 1x1 expand, 3x3 depthwise stride 2, 1x1 project.
    "mbv2_expand": ((2, 16, 9, 9), (96, 16, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    "mbv2_depthwise": ((2, 96, 9, 9), (96, 1, 3, 3), (2, 2), (1, 1), (1, 1), 96),
    "mbv2_project": ((2, 96, 5, 5), (24, 96, 1, 1), (1, 1), (0, 0), (1, 1), 1),
    "mbv2_stem": ((2, 3, 15, 15), (32, 3, 3, 3), (2, 2), (1, 1), (1, 1), 1),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d_matches_torch(case: str, bias: bool) -> None:
    x_shape, w_shape, stride, padding, dilation, groups = CONV_CASES[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    b = rng.standard_normal(w_shape[0])
    geometry = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    yt = F.conv2d(xt, wt, bt if bias else None, stride, padding, dilation, groups)
    (y,) = _run("conv2d", x, w, *([b] if bias else []), **geometry)
    _close(y, yt)

    gy = rng.standard_normal(y.shape)
    gxt, gwt, gbt = torch.autograd.grad(yt, (xt, wt, bt), _t(gy), allow_unused=True)
    (gx,) = _run("conv2d_input_grad", gy, w, x_shape=x_shape, **geometry)
    (gw,) = _run("conv2d_weight_grad", x, gy, w_shape=w_shape, **geometry)
    _close(gx, gxt)
    _close(gw, gwt)
    if bias:
        _close(gy.sum(axis=(0, 2, 3)), gbt)


def test_conv2d_float32_keeps_dtype() -> None:
    rng = np.random.default_rng(0)
    for x_shape, w_shape, stride, padding, dilation, groups in CONV_CASES.values():
        geometry = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
        x = rng.standard_normal(x_shape).astype(np.float32)
        w = rng.standard_normal(w_shape).astype(np.float32)
        (y,) = _run("conv2d", x, w, **geometry)
        gy = np.ones_like(y)
        (gx,) = _run("conv2d_input_grad", gy, w, x_shape=x_shape, **geometry)
        (gw,) = _run("conv2d_weight_grad", x, gy, w_shape=w_shape, **geometry)
        assert y.dtype == gx.dtype == gw.dtype == np.float32
        want = F.conv2d(torch.tensor(x), torch.tensor(w), None, stride, padding, dilation, groups)
        np.testing.assert_allclose(y, want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        ((2, 3, 5, 5), (4, 2, 3, 3), {}),  # channels do not fit groups=1
        ((2, 4, 5, 5), (3, 2, 3, 3), {"groups": 2}),  # out channels not divisible
        ((2, 3, 2, 2), (4, 3, 3, 3), {}),  # kernel larger than the input
        ((3, 5, 5), (4, 3, 3, 3), {}),  # not NCHW
        ((2, 3, 5, 5), (4, 3, 3, 3), {"stride": (0, 1)}),
        ((2, 3, 5, 5), (4, 3, 3, 3), {"padding": (1,)}),
    ],
)
def test_conv2d_shape_errors(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]
) -> None:
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1, **attrs}
    types = [TensorType(x_shape, DType.F32), TensorType(w_shape, DType.F32)]
    with pytest.raises(ShapeError, match="conv2d"):
        get_op("conv2d").infer_types(types, Attrs(geometry))


# -- pooling ------------------------------------------------------------------

# (x shape, kernel, stride, padding, dilation, ceil_mode)
MAX_CASES = {
    "k2s2": ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1), False),
    "k3s2p1": ((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), (1, 1), False),
    "ceil_overhang": ((1, 2, 8, 9), (3, 2), (2, 3), (1, 0), (1, 1), True),
    "ceil_no_extra": ((1, 2, 6, 6), (2, 2), (2, 2), (0, 0), (1, 1), True),
    "ceil_k3s2": ((2, 2, 10, 11), (3, 3), (2, 2), (0, 1), (1, 1), True),
    "dilated": ((2, 2, 9, 9), (2, 3), (1, 2), (1, 1), (2, 2), False),
    "dilated_ceil": ((1, 3, 10, 9), (3, 2), (2, 2), (1, 1), (2, 3), True),
    "overlap": ((2, 2, 6, 7), (3, 3), (1, 1), (1, 1), (1, 1), False),
    "chw": ((3, 6, 6), (2, 2), (2, 2), (0, 0), (1, 1), False),
}


@pytest.mark.parametrize("case", list(MAX_CASES))
def test_max_pool2d_matches_torch(case: str) -> None:
    x_shape, kernel, stride, padding, dilation, ceil_mode = MAX_CASES[case]
    attrs = {
        "kernel": kernel,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "ceil_mode": ceil_mode,
    }
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape)
    xt = _t(x, True)
    yt = F.max_pool2d(xt, kernel, stride, padding, dilation, ceil_mode)
    (y,) = _run("max_pool2d", x, **attrs)
    _close(y, yt)
    gy = rng.standard_normal(y.shape)
    (gxt,) = torch.autograd.grad(yt, xt, _t(gy))
    (gx,) = _run("max_pool2d_grad", gy, x, **attrs)
    _close(gx, gxt)


def test_max_pool2d_grad_goes_to_the_first_maximum() -> None:
    # Ties everywhere: ATen sends each window's gradient to its first maximum.
    x = np.zeros((1, 1, 4, 5))
    x[0, 0, 1:3, 1:4] = 1.0
    attrs = {"kernel": (3, 3), "stride": (1, 2), "padding": (1, 1), "dilation": (1, 1)}
    xt = _t(x, True)
    yt = F.max_pool2d(xt, attrs["kernel"], attrs["stride"], attrs["padding"], 1, True)
    gy = np.arange(1.0, 1.0 + yt.numel()).reshape(yt.shape)
    (gxt,) = torch.autograd.grad(yt, xt, _t(gy))
    (gx,) = _run("max_pool2d_grad", gy, x, ceil_mode=True, **attrs)
    _close(gx, gxt)


# (x shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_CASES = {
    "k2s2": ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), False, True, None),
    "k3s2p1": ((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), False, True, None),
    "k3s2p1_nopad": ((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), False, False, None),
    "ceil": ((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), True, True, None),
    "ceil_nopad": ((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), True, False, None),
    "ceil_overhang": ((1, 2, 8, 9), (3, 2), (2, 3), (1, 1), True, True, None),
    "ceil_overhang_nopad": ((1, 2, 8, 9), (3, 2), (2, 3), (1, 1), True, False, None),
    "divisor": ((2, 2, 6, 6), (2, 2), (2, 2), (0, 0), False, True, 3),
    "divisor_pad": ((2, 2, 6, 7), (3, 3), (2, 2), (1, 1), True, False, 5),
    "overlap": ((2, 2, 6, 7), (3, 2), (1, 1), (1, 1), False, False, None),
    "chw": ((3, 5, 4), (2, 2), (1, 1), (1, 0), False, False, None),
    "global": ((2, 4, 7, 7), (7, 7), (7, 7), (0, 0), False, True, None),
}


@pytest.mark.parametrize("case", list(AVG_CASES))
def test_avg_pool2d_matches_torch(case: str) -> None:
    x_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor = AVG_CASES[case]
    attrs = {
        "kernel": kernel,
        "stride": stride,
        "padding": padding,
        "ceil_mode": ceil_mode,
        "count_include_pad": count_include_pad,
        "divisor_override": divisor,
    }
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape)
    xt = _t(x, True)
    yt = F.avg_pool2d(xt, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
    (y,) = _run("avg_pool2d", x, **attrs)
    _close(y, yt)
    gy = rng.standard_normal(y.shape)
    (gxt,) = torch.autograd.grad(yt, xt, _t(gy))
    (gx,) = _run("avg_pool2d_grad", gy, x_shape=x_shape, **attrs)
    _close(gx, gxt)


def _torch_pool_shape(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int | None:
    try:
        y = F.max_pool2d(torch.zeros(1, 1, size, size), k, s, p, d, ceil)
    except RuntimeError:
        return None
    return int(y.shape[-1])


def test_pool_output_size_follows_aten() -> None:
    checked = 0
    for size, k, s, d, ceil in itertools.product(
        range(1, 9), (1, 2, 3, 4), (1, 2, 3), (1, 2), (False, True)
    ):
        for p in range(k // 2 + 1):
            want = _torch_pool_shape(size, k, s, p, d, ceil)
            attrs = {
                "kernel": (k, k),
                "stride": (s, s),
                "padding": (p, p),
                "dilation": (d, d),
                "ceil_mode": ceil,
            }
            x = TensorType((1, 1, size, size), DType.F32)
            if want is None:
                with pytest.raises(ShapeError):
                    get_op("max_pool2d").infer_types([x], Attrs(attrs))
            else:
                (got,) = get_op("max_pool2d").infer_types([x], Attrs(attrs))
                assert got.shape[-1] == want, (size, k, s, p, d, ceil)
                checked += 1
    assert checked > 500


def test_pool_rejects_padding_over_half_the_kernel() -> None:
    attrs = {
        "kernel": (2, 2),
        "stride": (2, 2),
        "padding": (2, 0),
        "ceil_mode": False,
        "count_include_pad": True,
        "divisor_override": None,
    }
    with pytest.raises(ShapeError, match="half the kernel"):
        get_op("avg_pool2d").infer_types([TensorType((1, 1, 6, 6), DType.F32)], Attrs(attrs))


# -- normalisation --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 5), (4, 3, 6, 5), (2, 4, 7)])
def test_batch_norm_matches_torch(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3 + 1
    w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    eps = 1e-5
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    yt = F.batch_norm(xt, None, None, wt, bt, training=True, eps=eps)
    y, mean, var = _run("batch_norm", x, w, b, eps=eps)
    _close(y, yt)
    axes = (0, *range(2, len(shape)))
    _close(mean, xt.mean(dim=axes))
    _close(var, xt.var(dim=axes, unbiased=False))

    gy = rng.standard_normal(shape)
    gxt, gwt, gbt = torch.autograd.grad(yt, (xt, wt, bt), _t(gy))
    gx, gw, gb = _run("batch_norm_grad", gy, x, w, mean, var, eps=eps)
    _close(gx, gxt)
    _close(gw, gwt)
    _close(gb, gbt)


@pytest.mark.parametrize(
    ("shape", "ndim"), [((4, 6), 1), ((2, 5, 8), 1), ((2, 3, 4, 5), 2), ((3, 4), 2)]
)
def test_layer_norm_matches_torch(shape: tuple[int, ...], ndim: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 2 - 1
    normalized = shape[len(shape) - ndim :]
    w, b = rng.standard_normal(normalized), rng.standard_normal(normalized)
    eps = 1e-5
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    yt = F.layer_norm(xt, normalized, wt, bt, eps)
    y, mean, rstd = _run("layer_norm", x, w, b, eps=eps, ndim=ndim)
    _close(y, yt)
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(xt, list(normalized), wt, bt, eps)
    assert mean.shape == tuple(mean_t.shape) and rstd.shape == tuple(rstd_t.shape)
    _close(mean, mean_t)
    _close(rstd, rstd_t)

    gy = rng.standard_normal(shape)
    gxt, gwt, gbt = torch.autograd.grad(yt, (xt, wt, bt), _t(gy))
    gx, gw, gb = _run("layer_norm_grad", gy, x, w, mean, rstd, ndim=ndim)
    _close(gx, gxt)
    _close(gw, gwt)
    _close(gb, gbt)


def test_norms_keep_float32() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    w = np.ones(3, np.float32)
    for out in _run("batch_norm", x, w, w, eps=1e-5):
        assert out.dtype == np.float32
    w2 = np.ones((5, 5), np.float32)
    for out in _run("layer_norm", x, w2, w2, eps=1e-5, ndim=2):
        assert out.dtype == np.float32
