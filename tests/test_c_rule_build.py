"""The convolution rule follows the build: where the GEMM has the wide FMA micro-kernels
(AVX2 or AVX-512, ``PE_FAST_GEMM``) the implicit GEMM beats Winograd F(2x2, 3x3) from 128
channels, so the rule takes F(2x2, 3x3) only up to ``WINOGRAD_FAST_GEMM_MAX`` there; a
portable build keeps it from ``WINOGRAD_MIN`` channels up.

- ``rule_kernel`` on ResNet-18's 3x3 layers, both ways; ``driver.has_fast_gemm`` agrees
  with the C headers' ``PE_FAST_GEMM`` for the same flags.
- A step compiled in process takes its build's rule; an exported trainer's step and table
  name both rules and the preprocessor picks its build's (portable: F(2x2, 3x3); built for
  a fast-GEMM machine: the implicit GEMM), both builds compile, and ``./train`` trains as
  the step does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine.backends.c.conv_kernels import (
    WINOGRAD_FAST_GEMM_MAX,
    WINOGRAD_MIN,
    ConvGeometry,
    rule_kernel,
)
from pockengine.backends.c.driver import KERNEL_DIR, has_fast_gemm, toolchain
from tests.conv_stacks import conv_stack
from tests.trainer_losses import trainer_losses

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


def _geometry(cin: int, cout: int, side: int, batch: int = 1) -> ConvGeometry:
    # n, c, h, w, o, kh, kw, oh, ow, stride, padding, dilation, groups
    return ConvGeometry(batch, cin, side, side, cout, 3, 3, side, side, 1, 1, 1, 1,
                        1, 1, 1)  # fmt: skip


@pytest.mark.parametrize("op", ["conv2d", "conv2d_input_grad"])
@pytest.mark.parametrize(("cin", "cout", "side"), [(32, 32, 6), (64, 64, 8), (128, 128, 28),
                                                   (256, 256, 14), (512, 512, 7),
                                                   (64, 128, 6), (128, 32, 6)])  # fmt: skip
def test_the_rule_takes_winograd_f2_by_the_build(op: str, cin: int, cout: int, side: int) -> None:
    g = _geometry(cin, cout, side)
    portable, fast = rule_kernel(op, g, 4), rule_kernel(op, g, 4, fast_gemm=True)
    if portable == "winograd4":  # enough tiles: F(4x4, 3x3) either way
        assert fast == "winograd4"
        return
    assert portable == "winograd" and min(cin, cout) >= WINOGRAD_MIN
    written = cout if op == "conv2d" else cin
    assert fast == ("winograd" if written <= WINOGRAD_FAST_GEMM_MAX else "im2col")


def test_has_fast_gemm_agrees_with_the_c_headers(tmp_path: Path) -> None:
    src = tmp_path / "isa.c"
    src.write_text('#include <stdio.h>\n#include "pe_isa.h"\n'
                   'int main(void) { printf("%d\\n", PE_FAST_GEMM); return 0; }\n')  # fmt: skip
    for portable in (True, False):
        tc = toolchain(portable, openmp=False)
        exe = tmp_path / f"isa{int(portable)}"
        subprocess.run([tc.compiler, *tc.flags, f"-I{KERNEL_DIR}", str(src), "-o", str(exe)],
                       check=True)  # fmt: skip
        printed = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
        assert printed.stdout.strip() == str(int(has_fast_gemm(portable)))
    assert not has_fast_gemm(True)


def _model() -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """Two 3x3 convolutions of 128 channels on 6 x 6 maps of one image: too few tiles for
    F(4x4, 3x3), F(2x2, 3x3) by the portable rule."""
    return conv_stack((128, 128), 6, 1, 3)


def _default_kernel(source: str) -> str:
    """The kernel the forward of the 128-channel layer takes with no table."""
    found = re.search(r"default:\s*pe_conv2d_(\w+?)_f32\(v_relu1", source)
    assert found is not None
    return found.group(1)


def test_the_step_and_the_exported_trainer_take_their_builds_rule(tmp_path: Path) -> None:
    model, loss_fn, batches = _model()
    step = pe.compile(model, loss_fn, batches[0], pe.optim.SGD(lr=0.05), backend="c")
    fast = has_fast_gemm()
    want = "im2col" if fast else "winograd"
    assert f"pe_conv2d_{want}_f32(v_relu1" in step._exec.source
    folder = step.export(tmp_path / "trainer", target="c")
    source = (folder / "step.c").read_text()
    assert "#if PE_FAST_GEMM" in source
    assert "PE_FAST_GEMM ? 2 : 4" in (folder / "convs.c").read_text()  # im2col, winograd
    for portable in (True, False):
        tc = toolchain(portable, openmp=False)
        flags = [*tc.flags, f"-I{folder / 'kernels'}", f"-I{folder}"]
        done = subprocess.run([tc.compiler, *flags, "-E", "-P", str(folder / "step.c")],
                              capture_output=True, text=True, check=True)  # fmt: skip
        build_fast = has_fast_gemm(portable)
        assert _default_kernel(done.stdout) == ("im2col" if build_fast else "winograd")
        for source in ("step.c", "convs.c"):  # both branches compile
            subprocess.run([tc.compiler, *flags, "-std=c11", "-D_POSIX_C_SOURCE=200809L",
                            "-fsyntax-only", str(folder / source)], check=True)  # fmt: skip
    losses = [step(*b) for b in batches]  # the plain build (the native one compiles above)
    np.testing.assert_allclose(trainer_losses(folder, batches), losses, rtol=1e-4)
