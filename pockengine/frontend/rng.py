"""Dropout randomness shared by the frontends.

Every dropout mask is ``random_mask(seed, salt=k)`` of one ``rng.seed`` state value
(k counts the masks of the graph); the seed advances by one per step, after every
mask has been drawn, so each step sees new masks and a run is reproducible.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.ir import DType, GraphBuilder, Role, TensorType, Value

__all__ = ["SEED", "DropoutSeed"]

SEED = "rng.seed"


class DropoutSeed:
    """Hands out dropout masks of one graph and advances the seed at its end."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b
        self.seed: Value | None = None
        self.salt = 0

    def mask(self, shape: tuple[int, ...], p: float, source: str) -> Value:
        """A keep-mask (1/(1-p) where kept, 0 where dropped) of ``shape``."""
        if self.seed is None:
            self.seed = self.b.input(SEED, TensorType((), DType.I64), Role.STATE)
        self.salt += 1
        return self.b.call(
            "random_mask", self.seed, source=source, shape=shape, p=float(p), salt=self.salt
        )

    def finish(self) -> None:
        """Advance the seed once per step (call after the last mask is drawn)."""
        if self.seed is not None:
            one = self.b.call("full", shape=(), value=1, dtype="i64", source="rng")
            self.b.effect("assign", self.seed, self.b.call("add", self.seed, one, source="rng"),
                          source="rng")  # fmt: skip

    def initial_values(self) -> dict[str, np.ndarray[Any, Any]]:
        return {SEED: np.zeros((), dtype=np.int64)} if self.seed is not None else {}
