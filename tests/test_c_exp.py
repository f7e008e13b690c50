"""The C backend's float exp (kernels/pe_exp.h's pe_exp32, which sigmoid, SiLU, softmax,
GELU, the losses and the attention kernels call so their loops vectorise) against libm's
double exp: within 1 ulp of the exact value on a grid of floats over [-110, 100] (1.05 ulp
on a target without fused multiply-add), the specials exact, NaN through, the vectorised
loop equal to the scalar call (tests/c_kernels/exp_check.c), built with the backend's
flags, portably, and with the address and undefined-behaviour sanitizers. The compiled ops
against NumPy: the op samples of tests/test_c_backend.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.c_check import STEPPED_FLAG_SETS

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_CHECK = Path(__file__).with_name("c_kernels") / "exp_check.c"


@STEPPED_FLAG_SETS
def test_float_exp_within_one_ulp(tmp_path: Path, flags: list[str], step: int) -> None:
    from pockengine.backends.c.driver import KERNEL_DIR

    binary = tmp_path / "exp_check"
    common = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno", "-I", str(KERNEL_DIR)]
    subprocess.run(["cc", *flags, *common, f"-DSTEP={step}u", str(_CHECK), "-o", str(binary),
                    "-lm"], check=True, capture_output=True, text=True)  # fmt: skip
    done = subprocess.run([str(binary)], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stdout + done.stderr
    grid = (0x42C80000 // step + 1) + (0x42DC0000 // step + 1)  # [0, 100] and [-110, 0]
    assert int(done.stdout.split()[1]) == grid + 9  # every case ran
