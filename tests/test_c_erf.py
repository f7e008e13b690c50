"""The C backend's float erf and exp(-x^2 / 2) (kernels/elementwise.h's pe_erf32 and
pe_gauss32, which the float GELU and its gradient call so their loops vectorise) against
libm's double erf and exp: within 1 ulp of the correctly rounded value on a dense grid of
floats, exact on the specials, NaN through
(tests/c_kernels/erf_check.c), built with the backend's flags, portably, with the address
and undefined-behaviour sanitizers, and for aarch64 under qemu (the GELU op samples of a
compiled step against NumPy: tests/test_c_backend.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_CHECK = Path(__file__).with_name("c_kernels") / "erf_check.c"


def _erf_check(tmp_path: Path, flags: list[str], step: int = 61, compiler: str = "cc",
               runner: list[str] | None = None) -> None:  # fmt: skip
    from pockengine.backends.c.driver import KERNEL_DIR

    binary = tmp_path / "erf_check"
    common = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
    subprocess.run([compiler, *flags, *common, f"-DSTEP={step}u", str(_CHECK),
                    str(KERNEL_DIR / "common.c"), "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True,
                          check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stdout + done.stderr
    grid = 0x40900000 // step + 1 + 0x41A00000 // step + 1  # floats in [0, 4.5], [0, 20]
    assert int(done.stdout.split()[1]) == grid + 10 + 96001  # every case ran


@pytest.mark.parametrize(
    ("flags", "step"),
    [
        (["-O3", "-march=native"], 61),
        (["-O3"], 61),  # portable
        (["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"], 997),
    ],
    ids=["native", "portable", "sanitized"],
)
def test_float_erf_and_gauss_within_one_ulp(tmp_path: Path, flags: list[str], step: int) -> None:
    _erf_check(tmp_path, flags, step)


def test_float_erf_on_aarch64(tmp_path: Path) -> None:
    """Needs Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing")
    _erf_check(tmp_path, ["-O3"], 9973, cross, [qemu, "-L", "/usr/aarch64-linux-gnu"])
