"""The best validation's weights: ``RUN/best.safetensors``, kept for ``RUN/model``.

At each validation ``BestWeights.offer`` keeps the weights of the best validation so far
(ties: the latest): only the values training changes (the trained params and the
model's buffers), read from the step (``released.step_values``), written atomically with
the validation row in the file's metadata, so that ``--resume`` keeps them too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pockengine.finetune.run_folder import checkpoint as ckpt_io
from pockengine.ir.arrays import Array
from pockengine.safetensors_io import LazyTensors, write_safetensors_to
from pockengine.tasks.config import FinetuneError

__all__ = ["BEST", "FORMAT", "BestWeights", "best_metric"]

BEST = "best.safetensors"
FORMAT = "pockengine-model/1"


def best_metric(kind: str) -> tuple[str, bool]:
    """The validation metric that ranks a task's weights, and whether higher is better."""
    return ("val_loss", False) if kind == "causal-lm" else ("val_accuracy", True)


class BestWeights:
    """The best validation so far (``row``) and its changed values (``BEST`` on disk)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.metric, self.higher = best_metric(kind)
        self.row: dict[str, Any] | None = None

    def offer(self, row: dict[str, Any], state: Mapping[str, Array], names: Iterable[str]) -> bool:
        """Keep the values ``names`` (``changed_names``: what training changes) of ``state``
        (the step's, by model name: ``released.step_values``) if ``row`` is at least as good
        as the best so far."""
        value = row.get(self.metric)
        if value is None:
            return False
        if self.row is not None:
            best = self.row[self.metric]
            if (value < best) if self.higher else (value > best):
                return False
        tensors = {n: state[n] for n in names if n in state}  # the trained values only
        meta = {"format": FORMAT, "row": json.dumps(row)}
        ckpt_io.write_atomic_with(self.path, lambda f: write_safetensors_to(f, tensors, meta))
        self.row = dict(row)
        return True

    def restore(self, step: int) -> None:
        """On resume: the best kept before, unless it is from past the checkpoint's step."""
        if not self.path.is_file():
            return
        row = _best_row(self.path)
        if int(row.get("step", step + 1)) <= step:
            self.row = row

    def tensors(self) -> Mapping[str, Array]:
        """The kept weights by name, each read from the file when looked up (a full
        fine-tune's best weights read whole were its run's peak while writing ``RUN/model``)."""
        return LazyTensors(self.path)


def _best_row(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        row = json.loads(meta["row"])
    except Exception as exc:  # a foreign or damaged file: say which
        raise FinetuneError(f"{path} is not the best weights of a pockengine run: {exc}") from exc
    if not isinstance(row, dict):
        raise FinetuneError(f"{path}: its metadata holds no validation row")
    return row
