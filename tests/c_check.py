"""Building and running a kernel check program of ``tests/c_kernels/`` (one that prints
"ok N", N its checks, and exits 0, or prints its failures and exits 1) against the
backend's kernel sources: with given flags (``FLAG_SETS``: the backend's own, portable, the
address and undefined-behaviour sanitizers), with a cross compiler under an emulator, the
checks counted."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pockengine.backends.c.driver import KERNEL_DIR

CHECKS = Path(__file__).with_name("c_kernels")
COMMON = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
SANITIZED = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
FLAG_SETS = pytest.mark.parametrize(
    "flags", [["-O3", "-march=native"], ["-O3"], SANITIZED], ids=["native", "portable", "sanitized"]
)
# The same builds for the checks that walk a grid of floats: each with its grid step (the
# sanitized build, about 10x slower, walks a coarser one).
STEPPED_FLAG_SETS = pytest.mark.parametrize(
    ("flags", "step"),
    [(["-O3", "-march=native"], 61), (["-O3"], 61), (SANITIZED, 997)],
    ids=["native", "portable", "sanitized"],
)


def run_check(
    tmp_path: Path,
    check: str,
    kernels: tuple[str, ...],
    flags: list[str],
    least: int,
    compiler: str = "cc",
    runner: list[str] | None = None,
    args: tuple[str, ...] = (),
) -> None:
    """Builds ``check`` (a file of tests/c_kernels/) with the ``kernels`` files and runs
    it (with ``args``): it passes, and ran at least ``least`` checks."""
    binary = tmp_path / Path(check).stem
    sources = [str(CHECKS / check), *(str(KERNEL_DIR / f) for f in kernels)]
    subprocess.run([compiler, *flags, *COMMON, *sources, "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary), *args], capture_output=True, text=True,
                          check=False, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("ok ") and int(done.stdout.split()[1]) >= least, done.stdout


def run_check_aarch64(
    tmp_path: Path,
    check: str,
    kernels: tuple[str, ...],
    least: int,
    args: tuple[str, ...] = (),
    flags: tuple[str, ...] = ("-O2",),
) -> None:
    """``run_check`` built for aarch64 (NEON) with ``flags`` and run under qemu; needs
    Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user")  # fmt: skip
    run_check(tmp_path, check, kernels, list(flags), least, cross,
              [qemu, "-L", "/usr/aarch64-linux-gnu"], args)  # fmt: skip
