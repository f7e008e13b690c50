"""What a fine-tuning run returns, and its printed summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pockengine.finetune.checkpoint import CHECKPOINT
from pockengine.finetune.config import FinetuneConfig
from pockengine.runtime import TrainStep

__all__ = ["FinetuneResult"]


@dataclass
class FinetuneResult:
    """The outcome of ``finetune``: counters, validation history, timings, the report."""

    config: FinetuneConfig
    out: Path
    steps: int
    total_steps: int
    epochs_done: int
    stopped: str | None  # None: ran to the end; else max_steps, SIGINT or SIGTERM
    history: list[dict[str, Any]]  # one validation row per finished epoch
    report: str  # str(step.report()): the compile-time facts of the scheme
    notes: list[str]
    wall_s: float
    compile_s: float
    step_s: float  # mean seconds per training step in this invocation
    train_examples: int
    val_examples: int
    labels: tuple[str, ...]
    inputs: str  # what one example is: "128 tokens", "3x64x64 images"
    step: TrainStep = field(repr=False)

    @property
    def finished(self) -> bool:
        return self.stopped is None

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def final(self) -> dict[str, Any]:
        """The last validation row (empty before the first epoch ends)."""
        return dict(self.history[-1]) if self.history else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "out": str(self.out),
            "steps": self.steps,
            "total_steps": self.total_steps,
            "epochs_done": self.epochs_done,
            "stopped": self.stopped,
            "final": self.final,
            "history": self.history,
            "notes": self.notes,
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "step_s": self.step_s,
            "train_examples": self.train_examples,
            "val_examples": self.val_examples,
            "labels": list(self.labels),
            "inputs": self.inputs,
        }

    def summary(self) -> str:
        """The run in a few lines, then the compile-time report."""
        c = self.config
        name = c.recipe or c.model
        state = (
            "finished" if self.finished else f"stopped ({self.stopped}); continue it with --resume"
        )
        rate = c.batch_size / self.step_s if self.step_s and c.batch_size else 0.0
        lines = [
            f"fine-tune {name}: {state} at step {self.steps}/{self.total_steps} "
            f"({self.epochs_done}/{c.epochs} epochs) in {self.wall_s:.1f} s",
            f"  scheme {c.scheme}, {c.optimizer} lr {c.lr:g} (linear warmup {c.warmup:g}, "
            f"then decay), batch {c.batch_size} x {self.inputs}, backend {c.backend}",
            *(f"  data: {note}" for note in self.notes),
            f"  compile {self.compile_s:.1f} s; step {self.step_s:.3f} s mean ({rate:.1f} ex/s)",
        ]
        for row in self.history:
            metrics = ", ".join(f"{k[4:]} {v:.4f}" for k, v in row.items() if k.startswith("val_"))
            lines.append(f"  epoch {row['epoch']} (step {row['step']}): {metrics}")
        lines += [
            f"  checkpoint {self.checkpoint}",
            f"  metrics {self.metrics_path}",
            "",
            self.report,
        ]
        return "\n".join(lines)
