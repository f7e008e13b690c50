"""Build and run a C kernel check (``tests/c_kernels/*_check.c``) against the backend's
kernel sources: the flag sets the checks are built with (the backend's, portable, the
address and undefined-behaviour sanitizers) and an aarch64 build run under qemu."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("c_kernels")

FLAG_SETS = pytest.mark.parametrize(
    "flags",
    [
        ["-O3", "-march=native"],
        ["-O3"],  # portable
        ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    ],
    ids=["native", "portable", "sanitized"],
)


def run_check(check: str, kernels: tuple[str, ...], tmp_path: Path, flags: list[str],
              compiler: str = "cc", runner: list[str] | None = None) -> str:  # fmt: skip
    """Builds ``c_kernels/<check>`` with the kernel files ``kernels``, runs it and returns its
    output, which must start with ``ok `` (the case count follows)."""
    from pockengine.backends.c.driver import KERNEL_DIR

    binary = tmp_path / Path(check).stem
    common = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
    sources = [str(CHECKS / check), *(str(KERNEL_DIR / f) for f in kernels)]
    subprocess.run([compiler, *flags, *common, *sources, "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True,
                          check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stdout + done.stderr
    return done.stdout


def run_check_on_aarch64(check: str, kernels: tuple[str, ...], tmp_path: Path) -> str:
    """``run_check`` cross-compiled for aarch64 (NEON) and run under qemu-aarch64; skips
    without Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing")
    return run_check(
        check, kernels, tmp_path, ["-O3"], cross, [qemu, "-L", "/usr/aarch64-linux-gnu"]
    )
