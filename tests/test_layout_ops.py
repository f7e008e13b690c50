"""The layout ops (``ops/layout.py``, ``ops/conv_nhwc.py``, ``ops/conv_blocked.py``):
``layout_convert`` against torch (its values and, by autograd, its gradient, which is the
inverse conversion), bad layouts refused with a ShapeError, and the C kernels
(conversions, depthwise NHWC and NCHW{c}c convolutions at strides 1 and 2 with 3x3 and 5x5
filters and more channels than one block, a padded last block, pointwise NHWC
convolutions as GEMMs) against NumPy in float32 and float64."""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest
import torch

import pockengine.ops  # noqa: F401  (registers the ops)
from pockengine.backends.c import CBackend
from pockengine.ir import DType, GraphBuilder, Role, ShapeError, TensorType, Value, get_op
from tests.c_numpy import matches_numpy

_convert = get_op("layout_convert").kernel


def _torch_convert(x: torch.Tensor, src: str, dst: str, channels: int) -> torch.Tensor:
    """The conversion written with torch's own ops (autograd differentiates it)."""
    if src == "NHWC":
        x = x.permute(0, 3, 1, 2)
    elif src != "NCHW":
        x = x.permute(0, 1, 4, 2, 3).flatten(1, 2)[:, :channels]
    if dst == "NHWC":
        return x.permute(0, 2, 3, 1)
    if dst == "NCHW":
        return x
    block = int(dst[4:-1])
    pad = -channels % block
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    n, c, h, w = x.shape
    return x.reshape(n, c // block, block, h, w).permute(0, 1, 3, 4, 2)


@pytest.mark.parametrize(
    ("src", "dst"),
    [("NCHW", "NHWC"), ("NHWC", "NCHW"), ("NCHW", "NCHW8c"), ("NCHW8c", "NHWC"),
     ("NHWC", "NCHW4c"), ("NCHW4c", "NCHW")],
)  # fmt: skip
def test_layout_convert_and_its_gradient_match_torch(src: str, dst: str) -> None:
    rng = np.random.default_rng(0)
    channels = 13
    nchw = rng.standard_normal((2, channels, 5, 3))
    x = _convert(nchw, src="NCHW", dst=src, channels=channels) if src != "NCHW" else nchw
    xt = torch.tensor(x, requires_grad=True)
    want = _torch_convert(xt, src, dst, channels)
    got = _convert(x, src=src, dst=dst, channels=channels)
    np.testing.assert_array_equal(got, want.detach().numpy())
    ct = rng.standard_normal(got.shape)
    want.backward(torch.tensor(ct))
    # the VJP rule: the inverse conversion of the cotangent
    grad = _convert(ct, src=dst, dst=src, channels=channels)
    assert xt.grad is not None
    np.testing.assert_array_equal(grad, xt.grad.numpy())


@pytest.mark.parametrize(
    ("shape", "attrs", "message"),
    [
        ((2, 3, 4, 5), {"src": "NCHW", "dst": "NCWH", "channels": 3}, "NCWH"),
        ((2, 3, 4, 5), {"src": "NCHW", "dst": "NCHW1c", "channels": 3}, "NCHW1c"),
        ((2, 3, 4, 5), {"src": "NCHW", "dst": "NHWC", "channels": 4}, "4 channels"),
        ((2, 1, 4, 5, 8), {"src": "NCHW8c", "dst": "NCHW", "channels": 9}, "9 channels"),
        ((2, 3, 4, 5), {"src": "NHWC", "dst": "NHWC", "channels": 5}, "both"),
    ],
)
def test_bad_layouts_are_shape_errors(
    shape: tuple[int, ...], attrs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ShapeError, match=message):
        get_op("layout_convert").infer(TensorType(shape, DType.F32), **attrs)


needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                              reason="no C compiler (cc or $CC)")  # fmt: skip

# (batch, channels in, channels out, groups, height, width, kernel, stride, padding)
_NHWC_CASES = [
    (2, 70, 70, 70, 7, 9, 3, 1, 1),  # two channel blocks, the second partial
    (2, 16, 16, 16, 9, 8, 3, 2, 1),
    (1, 12, 12, 12, 11, 6, 5, 2, 2),
    (1, 8, 8, 8, 4, 4, 5, 1, 2),
    (1, 20, 20, 20, 40, 37, 3, 1, 1),  # a map too large for the blocked kernels' halo copy
    (2, 24, 40, 1, 5, 3, 1, 1, 0),  # pointwise
]


def _nhwc_graph(dtype: DType) -> tuple[Any, list[Value], dict[str, Any]]:
    b = GraphBuilder("nhwc")
    outs: list[Value] = []
    feeds: dict[str, Any] = {}
    np_dtype = dtype.to_numpy()
    for i, (n, c, o, groups, h, w, k, s, p) in enumerate(_NHWC_CASES):
        rng = np.random.default_rng(i)
        attrs = {"stride": (s, s), "padding": (p, p), "dilation": (1, 1), "groups": groups}
        xs = rng.standard_normal((n, c, h, w)).astype(np_dtype)
        ws = rng.standard_normal((o, c // groups, k, k)).astype(np_dtype)
        bs = rng.standard_normal(o).astype(np_dtype)
        x = b.input(f"x{i}", TensorType(xs.shape, dtype), Role.INPUT)
        wv = b.input(f"w{i}", TensorType(ws.shape, dtype), Role.INPUT)
        bv = b.input(f"b{i}", TensorType(bs.shape, dtype), Role.INPUT)
        xl = b.call("layout_convert", x, src="NCHW", dst="NHWC", channels=c)
        y = b.call("conv2d_nhwc", xl, wv, bv, **attrs)
        gys = rng.standard_normal(y.shape).astype(np_dtype)
        gy = b.input(f"gy{i}", TensorType(gys.shape, dtype), Role.INPUT)
        gx = b.call("conv2d_nhwc_input_grad", gy, wv, x_shape=xl.shape, **attrs)
        gw = b.call("conv2d_nhwc_weight_grad", xl, gy, w_shape=ws.shape, **attrs)
        back = b.call("layout_convert", gx, src="NHWC", dst="NCHW", channels=c)
        blocked = b.call("layout_convert", xl, src="NHWC", dst="NCHW16c", channels=c)
        outs += [y, gx, gw, back, blocked]
        feeds.update({f"x{i}": xs, f"w{i}": ws, f"b{i}": bs, f"gy{i}": gys})
    return b.build(outs), outs, feeds


@needs_cc
@pytest.mark.parametrize("dtype", [DType.F32, DType.F64])
def test_nhwc_kernels_match_numpy(dtype: DType) -> None:
    graph, outs, feeds = _nhwc_graph(dtype)
    step = CBackend().compile(graph)
    sfx = "f32" if dtype is DType.F32 else "f64"
    assert f"pe_conv2d_nhwc_weight_grad_depthwise_{sfx}(" in step.source
    assert f"pe_gemm_{sfx}(" in step.source
    matches_numpy(step, graph, outs, feeds, dtype)


def _blocked_graph(dtype: DType, block: int) -> tuple[Any, list[Value], dict[str, Any]]:
    """The depthwise cases of ``_NHWC_CASES`` on NCHW{block}c maps, converted from NCHW
    and back, with both gradients."""
    b = GraphBuilder("nchwc")
    outs: list[Value] = []
    feeds: dict[str, Any] = {}
    np_dtype = dtype.to_numpy()
    layout = f"NCHW{block}c"
    for i, (n, c, o, groups, h, w, k, s, p) in enumerate(_NHWC_CASES):
        if groups == 1:
            continue
        rng = np.random.default_rng(i)
        attrs = {"stride": (s, s), "padding": (p, p), "dilation": (1, 1), "groups": groups}
        xs = rng.standard_normal((n, c, h, w)).astype(np_dtype)
        ws = rng.standard_normal((o, 1, k, k)).astype(np_dtype)
        bs = rng.standard_normal(o).astype(np_dtype)
        x = b.input(f"x{i}", TensorType(xs.shape, dtype), Role.INPUT)
        wv = b.input(f"w{i}", TensorType(ws.shape, dtype), Role.INPUT)
        bv = b.input(f"b{i}", TensorType(bs.shape, dtype), Role.INPUT)
        xl = b.call("layout_convert", x, src="NCHW", dst=layout, channels=c)
        y = b.call("conv2d_nchwc", xl, wv, bv, block=block, **attrs)
        yn = b.call("layout_convert", y, src=layout, dst="NCHW", channels=o)
        gys = rng.standard_normal(yn.shape).astype(np_dtype)
        gyv = b.input(f"gy{i}", TensorType(gys.shape, dtype), Role.INPUT)
        gy = b.call("layout_convert", gyv, src="NCHW", dst=layout, channels=o)
        gx = b.call("conv2d_nchwc_input_grad", gy, wv, x_shape=xs.shape, block=block, **attrs)
        gw = b.call("conv2d_nchwc_weight_grad", xl, gy, w_shape=ws.shape, block=block, **attrs)
        back = b.call("layout_convert", gx, src=layout, dst="NCHW", channels=c)
        outs += [y, yn, gx, gw, back]
        feeds.update({f"x{i}": xs, f"w{i}": ws, f"b{i}": bs, f"gy{i}": gys})
    return b.build(outs), outs, feeds


@needs_cc
@pytest.mark.parametrize(("dtype", "block"), [(DType.F32, 16), (DType.F64, 8), (DType.F32, 5)])
def test_blocked_kernels_match_numpy(dtype: DType, block: int) -> None:
    """Blocked results, padded lanes included (zeros), equal NumPy's."""
    graph, outs, feeds = _blocked_graph(dtype, block)
    step = CBackend().compile(graph)
    sfx = "f32" if dtype is DType.F32 else "f64"
    for kernel in ("", "_input_grad", "_weight_grad"):
        assert f"pe_conv2d_nchwc{kernel}_depthwise_{sfx}(" in step.source
    matches_numpy(step, graph, outs, feeds, dtype)


@needs_cc
@pytest.mark.parametrize("block", [16, 65])
def test_a_blocked_convolution_without_a_c_kernel_is_not_claimed(block: int) -> None:
    """Only depthwise NCHW{c}c convolutions with c up to 64 have C kernels."""
    from pockengine.backends.c.backend import claims

    b = GraphBuilder("blocked")
    x = b.input("x", TensorType((1, 1, 5, 5, block), DType.F32), Role.INPUT)
    dense = b.input("w", TensorType((6, 4, 3, 3), DType.F32), Role.INPUT)
    depthwise = b.input("d", TensorType((4, 1, 3, 3), DType.F32), Role.INPUT)
    geometry = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "block": block}
    b.call("conv2d_nchwc", x, dense, groups=1, **geometry)
    assert not claims(b.nodes[-1])
    b.call("conv2d_nchwc", x, depthwise, groups=4, **geometry)
    assert claims(b.nodes[-1]) == (block <= 64)


@needs_cc
def test_a_dense_nhwc_convolution_is_not_claimed_by_c() -> None:
    """Only depthwise and pointwise NHWC convolutions have C kernels; the layout pass
    never makes another, and the C backend does not claim one."""
    from pockengine.backends.c.backend import claims

    b = GraphBuilder("dense")
    x = b.input("x", TensorType((1, 5, 5, 4), DType.F32), Role.INPUT)
    w = b.input("w", TensorType((6, 4, 3, 3), DType.F32), Role.INPUT)
    b.call("conv2d_nhwc", x, w, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    assert not claims(b.nodes[-1])
