"""The C backend's convolution kernels against the NumPy backend: depthwise (3x3 and 5x5,
strides 1 and 2, padding, dilation, maps from 1 to 33 columns), pointwise (maps narrower
and wider than the GEMM's micro-kernel), dense and grouped ones (implicit GEMM: padding
smaller, equal to and larger than the filter's reach, dilation; a strided input gradient
as col2im of a product, in blocks of channels and positions; direct loops for a group
of too few channels), each forward, input gradient and
weight gradient, with the rule's kernels and with each node forced onto direct loops or the
implicit GEMM wherever valid, float32 (1e-5 relative to the sum of magnitudes) and
float64 (1e-12), all in one compiled graph. Winograd F(2x2, 3x3) and F(4x4, 3x3) (every
3x3 stride-1 case forced onto each, and each by the rule; F(4x4)'s weight gradient too)
meet the same tolerances: their
transforms add and scale before the products, so they round differently from direct
convolution, by about 1e-6 (F(2x2)) and 1e-5 (F(4x4)) of the largest output in float32."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pockengine.backends.c import CBackend, layout_tune, tune
from pockengine.backends.c.driver import KERNEL_DIR
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import DType, GraphBuilder, Role, TensorType, Value
from tests.c_check import FLAG_SETS, run_check, run_check_aarch64
from tests.c_numpy import matches_numpy
from tests.conv_stacks import conv_stack

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

# (batch, in channels, out channels, groups, height, width, kernel, stride, padding, dilation)
CASES = [
    (2, 8, 8, 8, 9, 9, 3, 1, 1, 1),
    (2, 8, 8, 8, 9, 33, 3, 2, 1, 1),
    (1, 5, 5, 5, 16, 16, 5, 1, 2, 1),
    (2, 4, 4, 4, 11, 13, 5, 2, 2, 1),
    (1, 3, 3, 3, 4, 4, 3, 1, 1, 1),
    (1, 3, 3, 3, 1, 1, 3, 1, 1, 1),
    (1, 6, 6, 6, 12, 10, 3, 1, 2, 2),
    (1, 4, 4, 4, 10, 10, 3, 2, 0, 1),
    (1, 4, 4, 4, 7, 7, 3, 3, 1, 1),
    (3, 24, 40, 1, 4, 4, 1, 1, 0, 1),
    (2, 16, 12, 1, 7, 7, 1, 1, 0, 1),
    (2, 20, 36, 1, 9, 11, 1, 1, 0, 1),
    (2, 3, 8, 1, 13, 13, 3, 2, 1, 1),
    (1, 6, 4, 2, 8, 8, 3, 1, 1, 1),
    (2, 5, 9, 1, 10, 12, 3, 1, 1, 1),
    (1, 8, 12, 1, 9, 9, 3, 1, 2, 2),
    (2, 8, 8, 2, 7, 9, 5, 1, 2, 1),
    (1, 6, 6, 1, 11, 11, 3, 1, 0, 1),
    (1, 4, 6, 1, 6, 6, 3, 1, 3, 1),
    (2, 12, 16, 4, 9, 9, 3, 2, 1, 1),
    # Winograd by the rule (>= 32 channels): two blocks of tiles, of input and of output
    # channels, a remainder of output channels, odd maps (cut tiles)
    (2, 40, 37, 1, 9, 7, 3, 1, 1, 1),
    # Winograd F(4x4, 3x3) by the rule (3 x 40 tiles >= 36 channels): two blocks of tiles,
    # of input channels and of output channels (more in float64), cut tiles at the bottom
    # and right edges
    (2, 20, 36, 1, 18, 15, 3, 1, 1, 1),
    # strided dense input gradients (col2im of a product): three blocks of channels (16 of
    # 3x3 a block, the last short) and two of positions (128 a block; 13 x 13 here); a 7x7
    # stem at stride 2; a 1x1 shortcut at stride 2; stride 3 with dilation, grouped
    (1, 40, 24, 1, 26, 25, 3, 2, 1, 1),
    (2, 3, 16, 1, 20, 18, 7, 2, 3, 1),
    (2, 16, 24, 1, 9, 9, 1, 2, 0, 1),
    (2, 12, 8, 2, 17, 16, 3, 3, 2, 2),
]


def _add(
    b: GraphBuilder, i: int, case: tuple[int, ...], dtype: DType
) -> tuple[list[Value], dict[str, Any]]:
    n, c, o, groups, h, w, k, s, p, d = case
    rng = np.random.default_rng(i)
    np_dtype = np.float32 if dtype is DType.F32 else np.float64
    xs = rng.standard_normal((n, c, h, w)).astype(np_dtype)
    ws = rng.standard_normal((o, c // groups, k, k)).astype(np_dtype)
    bs = rng.standard_normal((o,)).astype(np_dtype)
    attrs: dict[str, Any] = {
        "stride": (s, s),
        "padding": (p, p),
        "dilation": (d, d),
        "groups": groups,
    }
    tag = f"c{i}_{dtype.name}"
    x = b.input(f"{tag}.x", TensorType(xs.shape, dtype), Role.INPUT)
    wv = b.input(f"{tag}.w", TensorType(ws.shape, dtype), Role.INPUT)
    bv = b.input(f"{tag}.b", TensorType(bs.shape, dtype), Role.INPUT)
    y = b.call("conv2d", x, wv, bv, **attrs)
    gys = rng.standard_normal(y.shape).astype(np_dtype)
    gy = b.input(f"{tag}.gy", TensorType(gys.shape, dtype), Role.INPUT)
    gx = b.call("conv2d_input_grad", gy, wv, x_shape=xs.shape, **attrs)
    gw = b.call("conv2d_weight_grad", x, gy, w_shape=ws.shape, **attrs)
    feeds = {f"{tag}.x": xs, f"{tag}.w": ws, f"{tag}.b": bs, f"{tag}.gy": gys}
    return [y, gx, gw], feeds


@pytest.mark.parametrize("dtype", [DType.F32, DType.F64])
def test_convolutions_match_numpy(dtype: DType) -> None:
    b = GraphBuilder("convs")
    outs: list[Value] = []
    feeds: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        values, inputs = _add(b, i, case, dtype)
        outs += values
        feeds.update(inputs)
    graph = b.build(outs)
    step = CBackend().compile(graph)
    sfx = "f32" if dtype is DType.F32 else "f64"
    for op in ("conv2d", "conv2d_input_grad"):
        assert f"pe_{op}_winograd_{sfx}(" in step.source
        assert f"pe_{op}_winograd4_{sfx}(" in step.source
    assert f"pe_conv2d_weight_grad_winograd4_{sfx}(" in step.source
    matches_numpy(step, graph, outs, feeds, dtype)


@pytest.mark.parametrize("favour", ["direct", "im2col", "winograd", "winograd4", "blocked"])
def test_every_kernel_candidate_matches_numpy(
    favour: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case with each conv node on ``favour`` wherever that kernel is valid (the
    tuner's measurement replaced by times that rank it first): float32 as NumPy."""
    monkeypatch.setattr(tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(layout_tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(
        layout_tune,
        "measure_layouts",
        lambda op, nchw, *a: {nchw: 1e-6, layout_tune.NHWC_KERNEL: 1.0},
    )
    monkeypatch.setattr(
        tune, "measure", lambda op, kernels, *a: {k: 1e-6 if k == favour else 1.0 for k in kernels}
    )
    b = GraphBuilder("convs")
    outs: list[Value] = []
    feeds: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        values, inputs = _add(b, i, case, DType.F32)
        outs += values
        feeds.update(inputs)
    graph = b.build(outs)
    step = CBackend(tune=True).compile(graph)
    chosen = {c.kernel for c in step.kernel_choices}
    assert favour in chosen and f"pe_conv2d_input_grad_{favour}_f32(" in step.source
    got = step.run({}, dict(feeds))
    want = NumpyBackend().compile(graph).run(dict(feeds))
    for value, g, w in zip(outs, got, want, strict=True):
        scale = max(float(np.abs(w).max()), 1.0)
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * scale, err_msg=str(value))


@pytest.mark.parametrize(("size", "batch", "kernel"), [(10, 2, "winograd4"), (6, 1, "winograd")])
def test_winograd_trains_a_torch_initialised_cnn_as_numpy(
    size: int, batch: int, kernel: str
) -> None:
    """A VGG-style block (3x3 convolutions of 32 channels at stride 1: Winograd by the rule,
    forward and input gradient: F(4x4, 3x3) on 10x10 maps of 2 images, its weight gradient
    too, F(2x2, 3x3) on 6x6 maps of one, too few tiles for F(4x4)) with PyTorch's own
    initialisation, 5 SGD steps in float32: the losses and weights match NumPy's to rtol
    1e-4 (Winograd's rounding differs from direct convolution by about 1e-6 to 1e-5 of each
    output)."""
    import pockengine as pe

    model, loss_fn, batches = conv_stack((32, 32, 32), size, batch, 5, norm_after=(1,))
    steps = {
        b: pe.compile(model, loss_fn, batches[0], pe.optim.SGD(lr=0.05), backend=b)
        for b in ("numpy", "c")
    }
    source = steps["c"]._exec.source
    assert f"pe_conv2d_{kernel}_f32(" in source and f"pe_conv2d_input_grad_{kernel}_f32(" in source
    if kernel == "winograd4":
        assert "pe_conv2d_weight_grad_winograd4_f32(" in source
    for inputs in batches:
        want, got = steps["numpy"](*inputs), steps["c"](*inputs)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    for name, value in steps["numpy"].state_dict().items():
        np.testing.assert_allclose(steps["c"].state_dict()[name], value, rtol=1e-4, atol=1e-5)


_CONV_FILES = ("winograd.c", "depthwise.c", "dw_flat.c", "im2col.c", "linalg.c", "common.c")


@FLAG_SETS
def test_depthwise_winograd_and_im2col_kernels_on_random_geometries(
    tmp_path: Path, flags: list[str]
) -> None:
    run_check(tmp_path, "conv_check.c", _CONV_FILES, flags, least=150)


def test_winograd4_work_agrees_with_c_and_no_kernel_allocates() -> None:
    """``conv_kernels.winograd4_work`` (what the plan reserves) is ``pe_winograd4_work``
    (what the kernels use) on every op and many geometries, and the kernel files call no
    allocator: working memory is a slot of the plan, scratch is on the stack."""
    from pockengine.backends.c import tune_harness
    from pockengine.backends.c.conv_kernels import CONV_OPS, ConvGeometry, winograd4_work

    lib = tune_harness._library(None)
    lib.pe_winograd4_work.restype = ctypes.c_long
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, c, o, h, w = (int(v) for v in rng.integers(1, [4, 300, 300, 40, 40]))
        g = ConvGeometry(n, c, h, w, o, 3, 3, h, w, 1, 1, 1, 1, 1, 1, 1)
        longs = (ctypes.c_long * 18)(*g.longs())
        for i, op in enumerate(CONV_OPS):
            assert lib.pe_winograd4_work(i, longs) == winograd4_work(op, g), (op, g)
    for source in KERNEL_DIR.glob("*.c"):
        text = source.read_text()
        assert not any(f"{f}(" in text for f in ("malloc", "calloc", "realloc",
                                                 "aligned_alloc")), source.name  # fmt: skip


def test_depthwise_winograd_and_im2col_kernels_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, "conv_check.c", _CONV_FILES, least=150, flags=("-O3",))


def test_mobilenet_on_128_pixel_maps_trains_as_numpy() -> None:
    """MobileNetV2 (width 0.35) on 128 x 128 images, batch 2, float64, every weight trained,
    3 SGD momentum steps: its 64 x 64 -> 32 x 32 depthwise layer's input gradient takes the
    row kernels' stride-2 path, the 64 x 64 and 8 x 8 maps the whole-plane and row kernels,
    its products several runs of the GEMM's packed slivers; losses and weights match NumPy's
    to rtol 1e-7 and 1e-6."""
    import pockengine as pe
    from pockengine import zoo
    from pockengine.frontend.import_memo import reused_imports

    w = zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=2, size=128))
    batch = w.make_batch(0)
    with reused_imports():  # one torch.export for both backends
        opt = pe.optim.SGD(lr=0.01, momentum=0.9)
        steps = {b: pe.compile(w.model, w.loss_fn, batch, opt, backend=b) for b in ("numpy", "c")}
    assert "pe_conv2d_input_grad_depthwise_f64(" in steps["c"]._exec.source
    for i in range(3):
        batch = w.make_batch(i)
        want, got = steps["numpy"](*batch), steps["c"](*batch)
        assert got == pytest.approx(want, rel=1e-7), (i, got, want)
    for name, value in steps["numpy"].state_dict().items():
        np.testing.assert_allclose(steps["c"].state_dict()[name], value, rtol=1e-6, atol=1e-9,
                                   err_msg=name)  # fmt: skip
