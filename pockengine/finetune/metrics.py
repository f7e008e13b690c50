"""Evaluation in plain torch, and the metrics log (one JSON object a line).

Evaluation copies the trained values into the torch model (``step.load_into``) and
runs it in eval mode under ``torch.no_grad()``: the compiled step has a fixed batch
shape, the validation split need not. Classification reports accuracy and mean
cross-entropy; a causal LM reports the mean token loss and its perplexity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pockengine.finetune.checkpoint import write_json_lines
from pockengine.finetune.config import FinetuneError
from pockengine.finetune.recipes import Task
from pockengine.runtime import TrainStep

__all__ = ["MetricsLog", "evaluate"]


def evaluate(step: TrainStep, task: Task, batch_size: int = 64) -> dict[str, float]:
    """Validation metrics of the step's current weights (a causal LM in batches of at most
    8 sequences: its logits are as wide as the vocabulary)."""
    # Buffers the compiled step does not hold (ones the loss never reads) keep their values.
    loaded = step.load_into(task.model, strict=False)
    if loaded.unexpected or loaded.mismatched:
        raise FinetuneError(f"the trained values do not fit the model: {loaded.describe()}")
    was_training = task.model.training
    task.model.eval()
    try:
        with torch.no_grad():
            if task.kind == "causal-lm":
                return _causal_lm(task, min(batch_size, 8))
            return _classification(task, batch_size)
    finally:
        task.model.train(was_training)


def _classification(task: Task, batch_size: int) -> dict[str, float]:
    total_loss, correct = 0.0, 0
    n = task.val_size
    for start in range(0, n, batch_size):
        *inputs, labels = (torch.from_numpy(a[start : start + batch_size]) for a in task.val)
        logits = task.model(*inputs)
        total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(-1) == labels).sum())
    return {"val_loss": total_loss / n, "val_accuracy": correct / n}


def _causal_lm(task: Task, batch_size: int) -> dict[str, float]:
    """Validation chunks hold no padding: every next token is a target."""
    total_loss, tokens = 0.0, 0
    for start in range(0, task.val_size, batch_size):
        ids = torch.from_numpy(task.val[0][start : start + batch_size])
        logits = task.model(input_ids=ids, use_cache=False).logits[:, :-1]
        targets = ids[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum")
        total_loss += float(loss)
        tokens += int(targets.numel())
    mean = total_loss / max(tokens, 1)
    return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}


class MetricsLog:
    """``metrics.jsonl``: appended and flushed a line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, row: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(_plain(row)) + "\n")
            f.flush()

    def rows(self) -> list[dict[str, Any]]:
        """The complete lines (a line a killed run left half written is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out

    def truncate_after(self, step: int) -> None:
        """Keep only the lines up to training step ``step`` (those a checkpoint covers)."""
        if self.path.exists():
            keep = [
                r
                for r in self.rows()
                if r.get("event") != "summary" and int(r.get("step", 0)) <= step
            ]
            write_json_lines(self.path, keep)


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in row.items()}
