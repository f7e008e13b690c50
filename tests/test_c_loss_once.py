"""The loss head's merged kernel with the weight gradient, each logit made once and kept in
gw's buffer (``kernels/loss_once.c``), and loss.c's two passes where the logits do not fit
(tests/c_kernels/loss_once_check.c): every output against a double-precision reference,
two threads against one bit for bit, built with the backend's flags, portably (OpenMP
off), with the address and undefined-behaviour sanitizers, and for aarch64 under qemu.
The kernel on whole models is checked by tests/test_fused_loss.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pockengine.backends.c.driver import toolchain
from tests.c_check import SANITIZED, run_check, run_check_aarch64

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

CHECK = "loss_once_check.c"
KERNELS = ("linalg.c", "lowbit_gemm.c", "quant.c", "loss.c", "loss_once.c", "common.c")


@pytest.mark.parametrize(
    "flags",
    [list(toolchain().flags), ["-O3"], [*SANITIZED, "-fopenmp"]],
    ids=["native", "portable", "sanitized"],
)
def test_loss_once_kernel(tmp_path: Path, flags: list[str]) -> None:
    quick = ("quick",) if SANITIZED[0] in flags else ()  # fewer large shapes, same paths
    run_check(tmp_path, CHECK, KERNELS, flags, least=390, args=quick)


def test_loss_once_kernel_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, CHECK, KERNELS, least=390, args=("quick",))
