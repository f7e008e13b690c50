"""The C backend's GEMM (kernels/linalg.c, kernels/gemm_micro.h) under every micro-kernel.

``tests/c_kernels/gemm_check.c`` checks every transposition case, accumulation, edge tiles,
float and double against a double reference, and that a result does not depend on the
tile an element falls in, the thread count, or whether images are read side by side. It
is built here with the backend's flags (the native micro-kernel: AVX-512 on this machine),
without AVX-512 (the AVX2+FMA kernel), with ``PE_GEMM_PORTABLE`` (the portable C kernel),
without OpenMP, with the address and undefined-behaviour sanitizers, and for aarch64 (the
NEON kernel) run under qemu.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pockengine.backends.c.driver import KERNEL_DIR, toolchain
from tests.c_check import SANITIZED

CHECK = Path(__file__).with_name("c_kernels") / "gemm_check.c"
SOURCES = [str(CHECK), str(KERNEL_DIR / "linalg.c"), str(KERNEL_DIR / "common.c")]
COMMON = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    return set(info.read_text().split()) if info.exists() else set()


def _build_and_run(tmp_path: Path, flags: list[str], compiler: str = "cc",
                   runner: list[str] | None = None) -> str:  # fmt: skip
    binary = tmp_path / "gemm_check"
    subprocess.run([compiler, *flags, *COMMON, *SOURCES, "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True,
                          check=False, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok "), done.stdout
    return done.stdout


def test_gemm_with_the_backend_flags(tmp_path: Path) -> None:
    out = _build_and_run(tmp_path, list(toolchain().flags))
    assert int(out.split()[1]) >= 180  # every case ran


def test_gemm_avx2_kernel(tmp_path: Path) -> None:
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2+FMA")
    _build_and_run(tmp_path, ["-O3", "-march=native", "-mno-avx512f", "-fopenmp"])


def test_gemm_portable_kernel_one_thread(tmp_path: Path) -> None:
    _build_and_run(tmp_path, ["-O3", "-DPE_GEMM_PORTABLE"])


def test_gemm_under_the_sanitizers(tmp_path: Path) -> None:
    """The native micro-kernel with the address and undefined-behaviour sanitizers: the
    runs of packed slivers and the edge tiles stay inside their scratch and operands."""
    out = _build_and_run(tmp_path, [*SANITIZED, "-march=native"])
    assert int(out.split()[1]) >= 180


def test_gemm_neon_kernel_under_qemu(tmp_path: Path) -> None:
    """Needs Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user")  # fmt: skip
    _build_and_run(tmp_path, ["-O2"], cross, [qemu, "-L", "/usr/aarch64-linux-gnu"])
