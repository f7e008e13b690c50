"""The C backend's reductions over leading axes (a bias gradient: [tokens, features] ->
[features]) run as column sums: a block of double accumulators, every row read in order
(``lower_reduce._column_sums``), across more columns than one block holds; sum, sum_to and
mean against float64 NumPy rounded once to float32."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from pockengine.backends.c import CBackend
from pockengine.ir import DType, GraphBuilder, Role, TensorType

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


def test_sums_over_leading_axes_are_column_sums() -> None:
    shape = (3, 50, 2100)  # 2100 columns: a block of 2048 and a tail of 52
    b = GraphBuilder("g")
    x = b.input("x", TensorType(shape, DType.F32), Role.INPUT)
    outs = [
        b.call("sum_to", x, shape=(2100,)),
        b.call("sum", x, axes=(0, 1), keepdims=True),
        b.call("mean", x, axes=(0,), keepdims=False),
        b.call("sum", x, axes=(2,), keepdims=False),  # a trailing axis: the strided loop
    ]
    ex = CBackend().compile(b.build(outs))
    assert ex.source.count("c0 += 2048") == 3
    xs = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = ex.run({}, {"x": xs})
    wide = xs.astype(np.float64)
    want = [wide.sum((0, 1)), wide.sum((0, 1), keepdims=True), wide.mean(0), wide.sum(2)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.astype(np.float32), rtol=1e-6, atol=1e-6)
