"""Dropout randomness shared by the frontends.

Every dropout mask is ``random_mask(seed, salt=k)`` of one ``rng.seed`` state value
(k counts the masks of the graph); the seed advances by one per step, after every
mask has been drawn, so each step sees new masks and a run is reproducible.

Dropout itself lowers to ``where(keep, x * f(1/(1-p)), 0)`` with ``keep = ne(mask, 0)``
a bool (f: x's dtype), so what its backward keeps is that 1-byte keep-mask (as eager
PyTorch keeps a bool mask), not the float32 ``random_mask``, which dies in the forward.
A kept element is the same bits as ``x * mask``; a dropped one is +0.
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

    def dropout(self, x: Value, p: float, source: str) -> tuple[Value, Value]:
        """``x`` with elements dropped at rate ``p`` > 0 and the rest scaled by 1/(1-p)
        (every element dropped at p >= 1), and the bool keep-mask; see the module docstring."""
        keep = self.b.call(
            "ne", self.mask(x.shape, p, source), self._scalar(0.0, "f32", source), source=source
        )
        scale = float(np.float32(1.0 / (1.0 - p) if p < 1.0 else 0.0))
        dtype = str(x.dtype)
        scaled = self.b.call("mul", x, self._scalar(scale, dtype, source), source=source)
        zero = self._scalar(0.0, dtype, source)
        return self.b.call("where", keep, scaled, zero, source=source), keep

    def _scalar(self, value: float, dtype: str, source: str) -> Value:
        return self.b.call("full", source=source, shape=(), value=value, dtype=dtype)

    def finish(self) -> None:
        """Advance the seed once per step (call after the last mask is drawn)."""
        if self.seed is not None:
            one = self.b.call("full", shape=(), value=1, dtype="i64", source="rng")
            self.b.effect(
                "assign", self.seed, self.b.call("add", self.seed, one, source="rng"), source="rng"
            )

    def initial_values(self) -> dict[str, np.ndarray[Any, Any]]:
        return {SEED: np.zeros((), dtype=np.int64)} if self.seed is not None else {}
