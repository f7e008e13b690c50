"""What travels: the tensors a compiled step's training changes, and nothing else.

A ``TrainedSet`` is read once from a ``TrainStep``: the names of the params its scheme
trains and, for partial-channel updates, how many leading rows train, plus the float
buffers the step updates (BatchNorm running statistics). ``extract``
gives exactly those tensors (a partial one cut to its trained rows), ``merge`` writes
received ones back into a step (frozen rows keep the step's own values, which no
client ever changes), and ``nbytes`` counts what a message carries. Frozen weights
never leave the process that loaded them: every client starts from the same recipe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pockengine.federated.config import FederatedError
from pockengine.ir.arrays import Array
from pockengine.step.compiler import TrainStep

__all__ = ["TrainedSet", "full_model_bytes", "load_some", "nbytes"]


def nbytes(arrays: Mapping[str, Array]) -> int:
    """Bytes of tensor data in ``arrays`` (what a message carries, headers aside)."""
    return sum(int(np.asarray(a).nbytes) for a in arrays.values())


def full_model_bytes(step: TrainStep) -> int:
    """Bytes of every param and buffer of ``step`` as ``flat_state_dict()`` gives them
    (quantized weights as floats, tied ones under each name): what full-model FedAvg
    sends. Counted from the step's shapes and dtypes; no tensor is read or dequantized."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in step.state_specs().values())


@dataclass(frozen=True)
class TrainedSet:
    """What a step's training changes and a message carries: the trained params (name ->
    trained leading rows, None: all) and the float buffers the step updates (BatchNorm's
    running statistics: averaged like the params, or the server would evaluate with the
    statistics every client started from; integer counters stay local)."""

    rows: dict[str, int | None]
    shapes: dict[str, tuple[int, ...]]  # as sent: a partial param's trained rows only
    full_model_bytes: int  # every param and buffer: what full-model FedAvg sends
    buffers: frozenset[str] = frozenset()  # the statistics among ``rows`` (not trained)

    @classmethod
    def of(cls, step: TrainStep) -> TrainedSet:
        trained = set(step.trained)
        buffers = [n for n in step.written if n not in trained]
        state = step.flat_state_dict([*step.trained, *buffers])
        rows = {name: step.resolution.rows.get(name) for name in step.trained}
        rows.update({n: None for n in buffers if state[n].dtype.kind == "f"})
        shapes = {}
        for name, k in rows.items():
            shape = state[name].shape
            shapes[name] = shape if k is None else (k, *shape[1:])
        stats = frozenset(rows) - trained
        return cls(rows, shapes, full_model_bytes(step), stats)

    def extract(self, step: TrainStep) -> dict[str, Array]:
        """The trained tensors of ``step`` (partial ones: their trained rows)."""
        state = step.flat_state_dict(self.rows)
        return {name: self._cut(name, state[name]) for name in self.rows}

    def _cut(self, name: str, array: Array) -> Array:
        k = self.rows[name]
        return np.ascontiguousarray(array if k is None else array[:k])

    def check(self, arrays: Mapping[str, Array], where: str) -> None:
        """A ``FederatedError`` unless ``arrays`` are exactly the trained tensors."""
        if set(arrays) != set(self.rows):
            missing, extra = set(self.rows) - set(arrays), set(arrays) - set(self.rows)
            raise FederatedError(
                f"{where}: expected the trained tensors only; missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        for name, array in arrays.items():
            if tuple(array.shape) != self.shapes[name]:
                raise FederatedError(
                    f"{where}: {name} has shape {list(array.shape)}, expected "
                    f"{list(self.shapes[name])}"
                )

    def merge(self, step: TrainStep, arrays: Mapping[str, Array], where: str) -> None:
        """Load received trained tensors into ``step``; frozen rows keep their values."""
        self.check(arrays, where)
        partial = [name for name, k in self.rows.items() if k is not None]
        state = step.flat_state_dict(partial) if partial else {}
        full = {}
        for name, array in arrays.items():
            k = self.rows[name]
            if k is None:
                full[name] = np.asarray(array)
            else:
                whole = state[name].copy()
                whole[:k] = array
                full[name] = whole
        load_some(step, params=full, where=where)


def load_some(
    step: TrainStep,
    params: Mapping[str, Array] | None = None,
    optimizer: Mapping[str, Array] | None = None,
    *,
    where: str,
) -> None:
    """Load part of a step's state (the rest keeps its values); a ``FederatedError``
    if a name is not the step's or a shape differs."""
    result = step.load_state(params, optimizer, strict=False)
    if result.unexpected or result.mismatched:
        raise FederatedError(f"{where}: the state does not fit the step: {result.describe()}")
