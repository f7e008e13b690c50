"""The depthwise convolutions on NHWC and NCHW{c}c maps and the layout conversions
around them (``kernels/conv_nhwc.c``) against naive NCHW loops, exactly, on random
geometries (``tests/c_kernels/layout_check.c``: blocks of one cache line, the blocked fast
paths with their bordered copies, and of 5 channels, the general kernels; and the blocked
kernels on NCHW maps, the conversions folded in): with the
backend's flags, portably, under the address and undefined-behaviour sanitizers, and
built for aarch64 (NEON) under qemu."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.c_check import FLAG_SETS, run_check, run_check_aarch64

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_FILES = ("conv_nhwc.c", "depthwise.c", "dw_flat.c", "common.c")


@FLAG_SETS
def test_the_layout_kernels_on_random_geometries(tmp_path: Path, flags: list[str]) -> None:
    run_check(tmp_path, "layout_check.c", _FILES, flags, least=600)


def test_the_layout_kernels_on_aarch64(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, "layout_check.c", _FILES, least=600, flags=("-O3",))
