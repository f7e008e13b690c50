"""The estimate's backward passes, in micro-batches, summed into per-row scores as they go.

``estimate.estimate_scores`` needs, per candidate weight, the empirical Fisher per output
row (the mean over batches of g_b^2 summed over the row, g_b the batch-mean gradient of
batch b) and the mean gradient over batches. ``gradient_sums`` computes them with a step
compiled for a *micro-batch* (``rows`` examples) that trains only the candidates:

- a batch's gradient is the mean of its micro-batches' (the loss is a batch mean, so the
  two are equal up to rounding, and up to dropout's masks, which differ by micro-batch);
  a micro-batch of 4 of a 16-example batch saves a quarter of the activations;
- no weight outside the candidates gets a gradient (an embedding table's, the largest,
  is never computed), no optimizer state exists and the step shares the model's weights
  (``copies_deferred``: it never updates them);
- each batch's gradient is folded into the sums at once: two float32 arrays per
  candidate (this batch's gradient and the running total), never one per batch.

So the process's peak is the task, one copy of the weights, the micro-batch's
activations and twice the candidates' gradients, not a full step's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.frontend.imported import ImportedModel, ModelInfo
from pockengine.ir.arrays import Array

__all__ = ["GradientSums", "gradient_step", "gradient_sums", "micro_rows", "only"]
_CHUNK_BYTES = 8 << 20  # float64 scratch of ``GradientSums.rows``


@dataclass
class GradientSums:
    """Per weight: the per-row sum over batches of g_b^2, and the elementwise sum of g_b."""

    batches: int = 0
    squares: dict[str, Array] = field(default_factory=dict)  # float64, one per output row
    total: dict[str, Array] = field(default_factory=dict)  # float32, the weight's shape

    def add(self, grads: dict[str, Array]) -> None:
        """Fold in one batch's float32 gradients (the first batch's become the totals)."""
        self.batches += 1
        for name, g in grads.items():
            square = _row_squares(g)
            if name in self.total:
                self.squares[name] += square
                self.total[name] += g
            else:
                self.squares[name], self.total[name] = square, g

    def rows(self, name: str, value: Array) -> dict[str, list[float]]:
        """The three per-row scores of ``estimate.SCORES`` for weight ``name`` of ``value``."""
        total = self.total[name]
        axes = tuple(range(1, value.ndim))
        taylor, grad = np.empty(len(total)), np.empty(len(total))
        for rows in _row_chunks(total):
            mean = total[rows].astype(np.float64) / self.batches
            taylor[rows] = np.abs(mean * value[rows]).sum(axis=axes)
            grad[rows] = np.abs(mean).sum(axis=axes)
        return {
            "fisher": (self.squares[name] / self.batches).tolist(),
            "taylor": taylor.tolist(),
            "grad": grad.tolist(),
        }


def _row_chunks(a: Array) -> Iterator[slice]:
    """``a``'s rows, a few MiB of float64 scratch at a time: float64 copies of a whole
    weight would be the analysis' peak on a large one (SmolLM2's tied head: 216 MiB
    each)."""
    step = max(1, _CHUNK_BYTES // max(1, 8 * a[0].size))
    return (slice(start, start + step) for start in range(0, len(a), step))


def _row_squares(g: Array) -> Array:
    """Per row of ``g``: the sum of its squares, in float64."""
    axes = tuple(range(1, g.ndim))
    out = np.empty(len(g))
    for rows in _row_chunks(g):
        out[rows] = np.square(g[rows], dtype=np.float64).sum(axis=axes)
    return out


def micro_rows(batch_size: int, most: int) -> int:
    """The largest divisor of ``batch_size`` that is at most ``most`` (at least 1)."""
    return max(d for d in range(1, min(batch_size, max(1, most)) + 1) if batch_size % d == 0)


def only(names: Sequence[str]) -> Any:
    """The scheme of an estimate's gradient step: exactly ``names``, every BatchNorm on its
    running statistics (``Planner.gradient_step``)."""
    import glob

    from pockengine.sparse.schemes import select

    return select([glob.escape(n) for n in names], frozen_bn="eval")


def gradient_step(
    imported: ImportedModel, info: ModelInfo, names: Sequence[str], backend: str
) -> Any:
    """A step on ``backend`` of ``imported`` (a micro-batch's import) that trains only
    ``names``, with no optimizer state, sharing the model's weights, for
    ``TrainStep.gradients``. BatchNorm layers run as ``imported`` was exported
    (``Planner.gradient_step`` exports them all on their running statistics)."""
    from pockengine.backends import get_backend
    from pockengine.optim import SGD
    from pockengine.sparse.schemes import resolve_scheme
    from pockengine.step.compiler import TrainStep, apply_resolution
    from pockengine.step.parts import build_parts
    from pockengine.step.running import copies_deferred

    scheme = only(names)
    resolution = resolve_scheme(scheme, info)
    forward = apply_resolution(imported.graph, resolution)
    engine = get_backend(backend)
    with copies_deferred():  # gradients never write: the weights stay the model's
        parts = build_parts(imported, forward, SGD(lr=0.0), engine, resolution, info, scheme)
        return TrainStep.bound(parts, engine)


def _micro_batches(batch: tuple[Array, ...], rows: int) -> Iterator[tuple[Array, ...]]:
    size = len(batch[0])
    for start in range(0, size, rows):
        yield tuple(np.ascontiguousarray(a[start : start + rows]) for a in batch)


def gradient_sums(
    step: Any, batches: Sequence[tuple[Array, ...]], rows: int, names: set[str]
) -> GradientSums:
    """The sums of ``names``' batch gradients over ``batches``, each batch run as
    micro-batches of ``rows`` examples by ``step`` (compiled for ``rows``)."""
    from pockengine.step.compiler import release_free_memory

    sums = GradientSums()
    for batch in batches:
        release_free_memory()  # the last batch's freed blocks, before this one's
        grads: dict[str, Array] = {}
        parts = 0
        for part in _micro_batches(batch, rows):
            parts += 1
            for name, g in step.gradients(*part).items():
                if name not in names:
                    continue
                if name in grads:
                    grads[name] += g
                else:
                    grads[name] = np.array(g, dtype=np.float32, copy=True)
        for g in grads.values():
            g /= parts
        sums.add(grads)
    return sums
