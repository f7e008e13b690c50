"""What the C kernel tests share: a compiled C step's results against the NumPy backend's
on the same graph and feeds."""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import DType, Graph, Value


def matches_numpy(
    step: Any, graph: Graph, outs: list[Value], feeds: dict[str, Any], dtype: DType
) -> None:
    """``step`` (a compiled C step of ``graph``) gives NumPy's results, to float32 (or
    float64) rounding of each result's largest magnitude."""
    got = step.run({}, dict(feeds))
    want = NumpyBackend().compile(graph).run(dict(feeds))
    tol = 1e-5 if dtype is DType.F32 else 1e-12
    for value, g, w in zip(outs, got, want, strict=True):
        scale = max(float(np.abs(w).max()), 1.0)
        np.testing.assert_allclose(g, w, rtol=0, atol=tol * scale * 10, err_msg=str(value))
