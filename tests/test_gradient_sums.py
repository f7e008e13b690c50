"""``GradientSums``: the scores of ``--scheme auto``'s estimate, a few rows at a time."""

from __future__ import annotations

import numpy as np
import pytest

from pockengine.scheme_choice import gradient_sums
from pockengine.scheme_choice.gradient_sums import GradientSums


@pytest.mark.parametrize("chunk", [8, 200, 1 << 20], ids=["one-row", "some-rows", "whole"])
def test_scores_are_the_same_row_by_row(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """The per-row sums of squares and the Taylor and gradient scores equal the whole
    weight's float64 formulas, however many rows a chunk takes (chunking keeps a large
    weight's float64 copies out of the analysis' peak)."""
    monkeypatch.setattr(gradient_sums, "_CHUNK_BYTES", chunk)
    rng = np.random.default_rng(0)
    value = rng.standard_normal((37, 3, 5)).astype(np.float32)
    grads = [rng.standard_normal(value.shape).astype(np.float32) for _ in range(3)]
    sums = GradientSums()
    for g in grads:
        sums.add({"w": g.copy()})
    rows = sums.rows("w", value)

    g64 = [g.astype(np.float64) for g in grads]
    mean = sum(g64) / 3
    np.testing.assert_allclose(rows["fisher"], sum((g**2).sum(axis=(1, 2)) for g in g64) / 3)
    np.testing.assert_allclose(rows["taylor"], np.abs(mean * value).sum(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_allclose(rows["grad"], np.abs(mean).sum(axis=(1, 2)), rtol=1e-6)
    assert len(rows["fisher"]) == len(rows["taylor"]) == len(rows["grad"]) == 37


def test_a_vector_weight_scores_per_element() -> None:
    """A 1-D weight's rows are its elements."""
    sums = GradientSums()
    sums.add({"b": np.array([1.0, -2.0, 3.0], dtype=np.float32)})
    rows = sums.rows("b", np.array([2.0, 2.0, 2.0], dtype=np.float32))
    assert rows == {"fisher": [1.0, 4.0, 9.0], "taylor": [2.0, 4.0, 6.0], "grad": [1.0, 2.0, 3.0]}
