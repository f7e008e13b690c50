"""The C layer norm kernels (``kernels/norm.c``: statistics in vector lanes, the gradient's
row sums in lanes and its weight and bias sums by column blocks) against a double-precision
reference (tests/c_kernels/layer_norm_check.c) over rows of 1 to 2600 columns, with and
without weight and bias, rows far from zero; two threads against one bit for bit; built
with the backend's flags, portably (OpenMP off), with the address and undefined-behaviour
sanitizers, and for aarch64 under qemu. Whole models: test_c_backend's BERT layer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pockengine.backends.c.driver import toolchain
from tests.c_check import SANITIZED, run_check, run_check_aarch64

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

CHECK = "layer_norm_check.c"
KERNELS = ("norm.c", "common.c")


@pytest.mark.parametrize(
    "flags",
    [list(toolchain().flags), ["-O3"], [*SANITIZED, "-fopenmp"]],
    ids=["native", "portable", "sanitized"],
)
def test_layer_norm_kernels(tmp_path: Path, flags: list[str]) -> None:
    run_check(tmp_path, CHECK, KERNELS, flags, least=256)


def test_layer_norm_kernels_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, CHECK, KERNELS, least=256)
