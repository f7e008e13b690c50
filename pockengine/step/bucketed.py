"""One training step compiled for several batch shapes over one store of state.

Shapes are fixed at compile time, so data of very different lengths either pads to the
longest or compiles a step per length bucket. ``BucketedStep.sharing(steps)`` takes steps
compiled from one model, loss, optimizer and scheme at different batch shapes and makes
them one step: the step of the largest shape keeps its store (params, buffers, optimizer
state, learning rate, step count, dropout seed) and every other step runs on that same
store (the same dict of backend tensors, not a copy), so an update through any shape is
what the next call of any other shape reads, and there is one AdamW state. The other
steps' own copies are dropped. ``step(*batch)`` runs the step whose shapes the batch has,
after ``fit`` (when given) has cut the batch to one of them. Everything else (state,
checkpoints, ``report``, the evaluator) is the largest shape's, whose memory plan is the
largest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pockengine.ir import CompileError, Role
from pockengine.ir.arrays import Array
from pockengine.step.compiler import TrainStep
from pockengine.step.running import BatchError

__all__ = ["BucketedStep", "Shapes"]
Shapes = tuple[tuple[int, ...], ...]
Fit = Callable[[Sequence[Array]], Sequence[Array]]


def _shapes(step: TrainStep) -> Shapes:
    return tuple(v.shape for v in step.facts.batch)


def _state_types(step: TrainStep) -> dict[str, str]:
    return {v.name: str(v.type) for v in step.graph.inputs if v.role is not Role.INPUT}


class BucketedStep(TrainStep):
    """A ``TrainStep`` (the largest shape's) that also runs the batch shapes of the other
    steps it was made ``sharing``, all on its one store."""

    _by_shape: dict[Shapes, TrainStep]
    _fit: Fit | None

    @classmethod
    def sharing(cls, steps: Sequence[TrainStep], fit: Fit | None = None) -> BucketedStep:
        """One step over ``steps`` (compiled at different batch shapes; ``steps`` are
        consumed: use only the result). ``fit`` maps a batch to one of their shapes."""
        if not steps:
            raise CompileError("BucketedStep.sharing needs at least one step")
        largest = max(steps, key=lambda s: sum(int(np.prod(x)) for x in _shapes(s)))
        if any(s._homes is not None for s in steps):
            raise CompileError(
                "steps compiled with in_place=True train the module's own "
                "tensors and cannot share one store"
            )
        step = cls.__new__(cls)
        step.__dict__.update(largest.__dict__)
        step._own_written()  # nothing in the shared store is still the model's memory
        step._by_shape, step._fit = {}, fit
        types = _state_types(largest)
        for other in steps:
            shapes = _shapes(other)
            if shapes in step._by_shape:
                raise CompileError(f"two steps of the batch shapes {list(shapes)}")
            if _state_types(other) != types:
                diff = sorted(set(_state_types(other).items()) ^ set(types.items()))[:4]
                raise CompileError(
                    "steps that share a store must hold the same state "
                    f"(names, shapes, dtypes); they differ in {diff}"
                )
            if other is not largest:
                other._store = step._store  # one dict: every update seen by every shape
                other._lent.clear()
            step._by_shape[shapes] = other
        step._by_shape[_shapes(largest)] = step
        return step

    @property
    def shapes(self) -> tuple[Shapes, ...]:
        """The batch shapes this step runs, smallest first."""
        return tuple(sorted(self._by_shape, key=lambda s: sum(int(np.prod(x)) for x in s)))

    def step_for(self, batch: Sequence[Any]) -> tuple[TrainStep, tuple[Array, ...]]:
        """The step that runs ``batch`` and the batch as it runs it (``fit`` applied)."""
        arrays: Sequence[Array] = [_array(b) for b in batch]
        if self._fit is not None:
            arrays = self._fit(arrays)
        shapes = tuple(a.shape for a in arrays)
        step = self._by_shape.get(shapes)
        if step is None:
            compiled = [[list(x) for x in s] for s in self.shapes]
            raise BatchError(
                f"batch shapes {[list(s) for s in shapes]} are none of the "
                f"compiled ones: {compiled}"
            )
        return step, tuple(arrays)

    def __call__(self, *batch: Any) -> float:
        step, arrays = self.step_for(batch)
        if step is self:
            return super().__call__(*arrays)
        step.on_nonfinite = self.on_nonfinite
        skipped = step.skipped_steps
        self.calls += 1
        try:
            return step(*arrays)
        finally:
            self.skipped_steps += step.skipped_steps - skipped

    def gradients(self, *batch: Any) -> dict[str, Array]:
        """Gradients of the trained params on ``batch`` (through its shape's step)."""
        step, arrays = self.step_for(batch)
        return super().gradients(*arrays) if step is self else step.gradients(*arrays)


def _array(item: Any) -> Array:
    if isinstance(item, np.ndarray):
        return item
    if hasattr(item, "detach"):
        return np.asarray(item.detach().cpu().numpy())
    return np.asarray(item)
