"""The C backend's fused batch norm kernels (kernels/norm.c: batch norm + hardtanh, its
gradient, batch_norm_apply) against the unfused kernels they replace, bit for bit, in
float and double (tests/c_kernels/norm_check.c), built with the backend's flags, portably,
with the address and undefined-behaviour sanitizers, and for aarch64 under qemu."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_CHECK = Path(__file__).with_name("c_kernels") / "norm_check.c"


def _norm_check(tmp_path: Path, flags: list[str], compiler: str = "cc",
                runner: list[str] | None = None) -> None:  # fmt: skip
    from pockengine.backends.c.driver import KERNEL_DIR

    binary = tmp_path / "norm_check"
    common = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
    sources = [str(_CHECK), *(str(KERNEL_DIR / f) for f in ("norm.c", "common.c"))]
    subprocess.run([compiler, *flags, *common, *sources, "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True,
                          check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stdout + done.stderr
    assert int(done.stdout.split()[1]) == 400  # every case ran


@pytest.mark.parametrize(
    "flags",
    [
        ["-O3", "-march=native"],
        ["-O3"],  # portable
        ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    ],
    ids=["native", "portable", "sanitized"],
)
def test_fused_batch_norm_kernels_equal_the_unfused_ones(tmp_path: Path, flags: list[str]) -> None:
    _norm_check(tmp_path, flags)


def test_fused_batch_norm_kernels_on_aarch64(tmp_path: Path) -> None:
    """Needs Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing")
    _norm_check(tmp_path, ["-O3"], cross, [qemu, "-L", "/usr/aarch64-linux-gnu"])
