"""The C backend's float GELU math (kernels/elementwise.h): pe_erf32, which the float GELU
calls where the target has no fused multiply-add, within 1 ulp of libm's double erf on a
dense grid, odd, exact on the specials; the float GELU (pe_gelu32 where it fuses) within
2 eps |x| of x Phi(x) on the same grid as the normal distribution; and
pe_gelu_parts32, the normal distribution and density from which GELU's gradient is made,
Phi within 8 ulp (its lower tail too) and the density within 3 ulp, exact far out, NaN
through; GELU and its gradient within 2 ulp-scaled of the double formulas
(tests/c_kernels/gelu_check.c), built with the backend's flags, portably, with the address
and undefined-behaviour sanitizers, and for aarch64 under qemu (the GELU op samples of a
compiled step against NumPy: tests/test_c_backend.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.c_check import STEPPED_FLAG_SETS

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_CHECK = Path(__file__).with_name("c_kernels") / "gelu_check.c"


def _gelu_check(tmp_path: Path, flags: list[str], step: int = 61, compiler: str = "cc",
               runner: list[str] | None = None) -> None:  # fmt: skip
    from pockengine.backends.c.driver import KERNEL_DIR

    binary = tmp_path / "gelu_check"
    common = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
    subprocess.run([compiler, *flags, *common, f"-DSTEP={step}u", str(_CHECK),
                    str(KERNEL_DIR / "common.c"), "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True,
                          check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stdout + done.stderr
    erf_grid = 0x40900000 // step + 1  # floats in [0, 4.5], each with its negative
    grid = 2 * (0x41480000 // step + 1)  # floats in [-12.5, 12.5]
    assert int(done.stdout.split()[1]) == erf_grid + 10 + grid + 7 + 4 + 96001  # every case


@STEPPED_FLAG_SETS
def test_float_normal_distribution_and_gelu(tmp_path: Path, flags: list[str], step: int) -> None:
    _gelu_check(tmp_path, flags, step)


def test_float_gelu_on_aarch64(tmp_path: Path) -> None:
    """Needs Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing")
    _gelu_check(tmp_path, ["-O3"], 9973, cross, [qemu, "-L", "/usr/aarch64-linux-gnu"])
