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
