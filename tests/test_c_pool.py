"""The C backend's max pooling and its gradient against the NumPy backend, bit for bit, on
inputs full of ties and with NaNs: windows inside the input (the row-at-a-time loops,
with no padding and, padded, for the windows that do not reach the padding) and the rest
(the windows reaching the padding, dilation, ceil_mode windows past the edge: the general
loop), float32 and float64, rows longer than one run of windows; and the kernels alone
on random geometries, sanitized too (``tests/c_kernels/pool_check.c``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pockengine.backends.c import CBackend
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import DType, GraphBuilder, Role, TensorType, Value
from tests.c_check import FLAG_SETS, run_check

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

# (x shape, kernel, stride, padding, dilation, ceil_mode)
CASES = [
    ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1), False),  # inside
    ((1, 2, 9, 11), (3, 3), (2, 2), (0, 0), (1, 1), False),  # inside, overlapping windows
    ((1, 2, 7, 7), (3, 2), (1, 3), (0, 0), (1, 1), False),  # inside, stride 1 and 3
    ((1, 1, 4, 150), (2, 2), (1, 1), (0, 0), (1, 1), False),  # a row of 149 windows
    ((2, 2, 9, 9), (2, 2), (2, 2), (0, 0), (1, 1), True),  # ceil_mode: the last past the edge
    ((1, 2, 8, 8), (3, 3), (2, 2), (1, 1), (1, 1), False),  # padding
    ((1, 2, 9, 9), (2, 3), (1, 2), (0, 0), (2, 2), False),  # dilation
    ((3, 6, 6), (2, 2), (2, 2), (0, 0), (1, 1), False),  # no batch axis
    # padded: the windows inside by the row loops, those reaching the padding by the general
    ((2, 3, 17, 16), (3, 3), (2, 2), (1, 1), (1, 1), False),  # ResNet's stem pooling
    ((1, 2, 10, 11), (3, 3), (2, 2), (1, 1), (1, 1), True),  # and ceil_mode
    ((1, 2, 7, 9), (2, 3), (1, 1), (1, 0), (1, 1), False),  # padding on one axis, stride 1
    ((1, 2, 6, 9), (3, 2), (3, 2), (0, 1), (1, 1), False),  # the other axis, stride 3 and 2
    ((1, 1, 5, 300), (3, 3), (2, 2), (1, 1), (1, 1), False),  # rows longer than a run
    ((1, 2, 3, 2), (3, 3), (1, 1), (1, 1), (1, 1), False),  # no window inside
]


def _graph(dtype: DType) -> tuple[Any, list[Value], dict[str, Any]]:
    b = GraphBuilder("pools")
    outs: list[Value] = []
    feeds: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    np_dtype = np.float32 if dtype is DType.F32 else np.float64
    for i, (shape, kernel, stride, padding, dilation, ceil_mode) in enumerate(CASES):
        xs = rng.integers(-2, 3, shape).astype(np_dtype)  # ties in nearly every window
        xs.flat[rng.choice(xs.size, max(1, xs.size // 40), replace=False)] = np.nan
        attrs = {"kernel": kernel, "stride": stride, "padding": padding,
                 "dilation": dilation, "ceil_mode": ceil_mode}  # fmt: skip
        x = b.input(f"x{i}", TensorType(shape, dtype), Role.INPUT)
        y = b.call("max_pool2d", x, **attrs)
        gys = rng.integers(1, 9, y.shape).astype(np_dtype)
        gy = b.input(f"gy{i}", TensorType(y.shape, dtype), Role.INPUT)
        outs += [y, b.call("max_pool2d_grad", gy, x, **attrs)]
        feeds.update({f"x{i}": xs, f"gy{i}": gys})
    return b.build(outs), outs, feeds


@pytest.mark.parametrize("dtype", [DType.F32, DType.F64])
def test_max_pooling_matches_numpy_bit_for_bit(dtype: DType) -> None:
    graph, outs, feeds = _graph(dtype)
    got = CBackend().compile(graph).run({}, dict(feeds))
    want = NumpyBackend().compile(graph).run(dict(feeds))
    for value, g, w in zip(outs, got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=str(value))


@FLAG_SETS
def test_max_pooling_on_random_geometries(tmp_path: Path, flags: list[str]) -> None:
    """``tests/c_kernels/pool_check.c``: random geometries against naive loops, built with
    the backend's flags, portably and with the sanitizers."""
    run_check(tmp_path, "pool_check.c", ("pool.c", "common.c"), flags, least=300)
