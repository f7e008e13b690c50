"""The C backend's fused batch norm kernels (kernels/norm.c: batch norm + hardtanh, its
gradient, batch_norm_apply) against the unfused kernels they replace, bit for bit, in
float and double (tests/c_kernels/norm_check.c), built with the backend's flags, portably,
with the address and undefined-behaviour sanitizers, and for aarch64 under qemu."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pockengine.backends.c import CBackend
from pockengine.ir import DType, GraphBuilder, Role, TensorType
from tests.c_check import FLAG_SETS, run_check, run_check_aarch64

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


@FLAG_SETS
def test_fused_batch_norm_kernels_equal_the_unfused_ones(tmp_path: Path, flags: list[str]) -> None:
    run_check(tmp_path, "norm_check.c", ("norm.c", "common.c"), flags, least=400)


def test_fused_batch_norm_kernels_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, "norm_check.c", ("norm.c", "common.c"), least=400, flags=("-O3",))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spatial", [(4, 4), (9, 7), (40, 40)])
def test_batch_norm_statistics_of_an_offset_channel(dtype: str, spatial: tuple[int, int]) -> None:
    """The one-pass statistics (kernels/norm.c: sums of x - k and its square, k the
    channel's first element) on channels whose mean is 10^4 times their spread, where a raw
    sum of squares would lose every digit of the variance: mean and variance as NumPy's
    float64 ones, to float rounding; rows shorter than a vector and longer than a block."""
    rng = np.random.default_rng(3)
    shape = (3, 5, *spatial)
    offsets = np.array([1e4, -3e4, 0.0, 5e3, 2e4]).reshape(1, 5, 1, 1)
    x = (offsets + rng.standard_normal(shape)).astype(dtype)
    b = GraphBuilder("bn_stats")
    dt = DType.F32 if dtype == "float32" else DType.F64
    xv = b.input("x", TensorType(shape, dt), Role.INPUT)
    wv = b.input("w", TensorType((5,), dt), Role.INPUT)
    bv = b.input("b", TensorType((5,), dt), Role.INPUT)
    outs = b.call_multi("batch_norm", xv, wv, bv, eps=1e-5)
    graph = b.build(list(outs))
    store = {"x": x, "w": np.ones(5, dtype), "b": np.zeros(5, dtype)}
    y, mean, var = CBackend().compile(graph).run(store, {})
    x64 = x.astype(np.float64)
    want_mean, want_var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    tol = 1e-6 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(mean, want_mean, rtol=tol, atol=tol)
    # the variance (about 1) to float rounding of the inputs' magnitude (10^4)
    np.testing.assert_allclose(var, want_var, rtol=0, atol=tol * 1e4 * 4)
    want_y = (x64 - want_mean.reshape(1, 5, 1, 1)) / np.sqrt(want_var.reshape(1, 5, 1, 1) + 1e-5)
    np.testing.assert_allclose(y, want_y, rtol=0, atol=tol * 1e4 * 4)


def test_an_unread_batch_norm_input_gradient_is_not_computed() -> None:
    """Bias-only training of a stem conv-bn-relu6 (no conv bias): nothing reads the stem
    batch norm's input gradient, so the C step passes its kernel no gx; the biases and the
    running statistics still train as on the NumPy backend over 5 steps."""
    import torch
    from torch import nn

    import pockengine as pe
    from pockengine import zoo

    torch.manual_seed(0)
    model = nn.Sequential(
        zoo.ConvBNReLU(3, 8, 3, stride=2),
        zoo.ConvBNReLU(8, 8, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((4, 3, 12, 12), generator=g), torch.randint(0, 5, (4,), generator=g)

    w = zoo.as_double(zoo.Workload("stem", model, zoo._classify, make))
    batch, scheme = w.make_batch(0), pe.schemes.bias_only()
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=pe.optim.SGD(lr=0.05), scheme=scheme)
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=pe.optim.SGD(lr=0.05),
                      scheme=scheme, backend=CBackend())  # fmt: skip
    calls = [line for line in ours._exec.source.splitlines()
             if "pe_batch_norm_hardtanh_grad_f64(" in line]  # fmt: skip
    assert len(calls) == 2 and sum(", NULL, " in line for line in calls) == 1, calls
    for i in range(5):
        batch = w.make_batch(i)
        want, got = ref(*batch), ours(*batch)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (i, got, want)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[name], value, rtol=1e-8, atol=1e-10)
