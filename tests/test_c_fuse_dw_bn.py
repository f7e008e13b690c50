"""The C backend's depthwise convolution over a batch-normed input (backends/c/fuse_dw_bn.py,
kernels/dw_bn.c), and the pointwise one on large maps: the fused kernels equal the unfused
ones bit for bit (natively, portably, sanitized and on aarch64), the rewrite fires only
where the NCHW depthwise kernels or a pointwise GEMM on 32 x 32 maps and up would run, and
a step with it trains exactly as the C step without it, and as NumPy does to float32
tolerance, over 5 steps."""

from __future__ import annotations

import contextlib
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend, backend, lowering
from pockengine.backends.c.fuse_dw_bn import fuse_depthwise_batch_norm
from pockengine.ir import verify
from tests.c_check import FLAG_SETS, run_check, run_check_aarch64

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

_FILES = ("dw_bn.c", "depthwise.c", "dw_flat.c", "norm.c", "linalg.c", "common.c")


@FLAG_SETS
def test_fused_kernels_equal_the_unfused_ones_bit_for_bit(tmp_path: Path, flags: list[str]) -> None:
    run_check(tmp_path, "dw_bn_check.c", _FILES, flags, least=150)


def test_fused_kernels_equal_the_unfused_ones_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, "dw_bn_check.c", _FILES, least=150, flags=("-O3",))


def _net() -> zoo.Workload:
    """A stem, an expanding inverted residual on 32 x 32 maps (fused: the depthwise
    kernels, NCHW), a strided one down to 16 x 16 and one down to 4 x 4 (its depthwise
    convolution runs NHWC, so not fused), in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(
        zoo.ConvBNReLU(3, 8, 3, stride=2),
        zoo.InvertedResidual(8, 8, stride=1, expand=3),
        zoo.InvertedResidual(8, 8, stride=2, expand=2),
        zoo.InvertedResidual(8, 12, stride=4, expand=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12, 5),
    )

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((3, 3, 64, 64), generator=g), torch.randint(0, 5, (3,), generator=g)

    return zoo.Workload("dw-bn", model, zoo._classify, make)


@contextlib.contextmanager
def _without_the_rewrite() -> Iterator[None]:
    saved = lowering.LOWERING_PASSES, backend.CBackend.lowering_passes
    passes = tuple(p for p in saved[0] if p is not fuse_depthwise_batch_norm)
    lowering.LOWERING_PASSES = passes
    backend.CBackend.lowering_passes = lambda self: passes  # type: ignore[method-assign]
    try:
        yield
    finally:
        lowering.LOWERING_PASSES, backend.CBackend.lowering_passes = saved


def _compile(w: zoo.Workload, backend_: Any) -> Any:
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.SGD(lr=0.05, momentum=0.9),
                      backend=backend_)  # fmt: skip


@pytest.fixture(scope="module")
def steps() -> tuple[Any, Any, Any, zoo.Workload]:
    w = _net()
    with _without_the_rewrite():
        unfused = _compile(w, CBackend())
    return _compile(w, "numpy"), unfused, _compile(w, CBackend()), w


def test_the_rewrite_fires_on_the_nchw_depthwise_and_large_pointwise_convolutions(
    steps: Any,
) -> None:
    _, unfused, fused, _ = steps
    before, after = (Counter(n.op for n in s._exec.graph.nodes) for s in (unfused, fused))
    verify(fused._exec.graph)
    # the 32 x 32 block's depthwise forward and weight gradient, and the weight gradient of
    # the strided block (a 32 x 32 input; its forward's output rows, 64 bytes, run direct
    # loops); the 16 x 16 and 4 x 4 (the blocked kernels) ones are left alone. Forward, the 32 x 32
    # block's projection (pointwise; its weight gradient reads a rematerialised z) too
    forwards = [n for n in fused._exec.graph.nodes if n.op == "conv2d_bn_hardtanh"]
    kernels = sorted(n.inputs[3].shape[1:] for n in forwards)
    assert kernels == [(1, 3, 3), (24, 1, 1)] and after["conv2d_bn_hardtanh_weight_grad"] == 2
    assert all(n.inputs[0].shape[2:] == (32, 32) for n in forwards)
    assert after["conv2d_nhwc"] == before["conv2d_nhwc"] == 0
    assert "pe_conv2d_blocked_f32(" in fused._exec.source
    assert before["batch_norm_hardtanh"] - after["batch_norm_hardtanh"] == 2
    assert before["batch_norm_apply"] - after["batch_norm_apply"] == 2
    # the normalised inputs of the fused convolutions are made nowhere, so never planned
    made = {v.name for n in fused._exec.graph.nodes for v in n.outputs}
    for fwd in forwards:
        gone = next(n for n in unfused._exec.graph.nodes if n.outputs[0] == fwd.outputs[0])
        assert gone.inputs[0].name not in made | set(fused._exec.plan.offsets)
    assert fuse_depthwise_batch_norm(fused._exec.graph) is fused._exec.graph


def test_fused_training_equals_the_unfused_c_step_and_numpy(steps: Any) -> None:
    numpy_step, unfused, fused, w = steps
    for i in range(5):
        batch = w.make_batch(i)
        want, plain, got = numpy_step(*batch), unfused(*batch), fused(*batch)
        assert got == plain, i  # bit for bit
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), i
    for name, value in unfused.state_dict().items():
        assert np.array_equal(fused.state_dict()[name], value), name
        np.testing.assert_allclose(value, numpy_step.state_dict()[name], rtol=1e-4, atol=1e-5)
