"""What a fine-tuning run returns, and the one screen it ends with.

``FinetuneResult.summary()`` is that screen: the state of the run, the scheme and its
trained parameters, the data, the final and best validation metric, time and
throughput, the whole-process peak RSS beside the step's planned peak, and the files in
the run folder. The compile-time report (a table per layer) is ``RUN/report.txt``;
``pockengine finetune --report`` prints it too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pockengine.finetune.run_folder.checkpoint import CHECKPOINT, write_atomic
from pockengine.step.running import CompiledStep
from pockengine.tasks.config import FinetuneConfig

__all__ = [
    "REPORT",
    "FinetuneResult",
    "best_row",
    "peak_rss_bytes",
    "primary_metric",
    "write_report",
]

log = logging.getLogger(__name__)

REPORT = "report.txt"
_MIB = 1 << 20

# What each file of a run folder is, in the order the screen lists them; files not named
# here are listed after these, without a description.
_FILES = {
    "model": "the fine-tuned model, in its own format (pe.load_run)",
    "adapter": "LoRA adapters as PEFT's files (PeftModel.from_pretrained)",
    CHECKPOINT: "trained values, optimizer state, data order: what --resume reads",
    "best.safetensors": "the best validation's weights, kept for model/",
    "metrics.jsonl": "training loss every --log-every steps, validation each epoch",
    "summary.json": "this result",
    REPORT: "the compile-time report, per layer (--report prints it)",
    "curves.png": "loss and validation metric against step (pockengine plot)",
}


def write_report(out: Path, report: str) -> None:
    """``out/report.txt``, atomically; a report that cannot be written costs one log line,
    not the run (the checkpoint's own write says loudly when the disk is the problem)."""
    try:
        write_atomic(out / REPORT, f"{report}\n".encode())
    except OSError as exc:
        log.warning("%s not written: %s", out / REPORT, exc)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (0 where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux: KiB


def primary_metric(row: dict[str, Any]) -> str:
    """The validation metric a row is judged by: accuracy, else perplexity, else loss."""
    return next((m for m in ("val_accuracy", "val_perplexity", "val_loss") if m in row), "")


def best_row(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The best validation row (highest accuracy, or lowest perplexity or loss); a tie
    goes to the later row. Empty before the first validation."""
    if not history:
        return {}
    metric = primary_metric(history[-1])
    sign = 1.0 if metric == "val_accuracy" else -1.0
    best = max(range(len(history)), key=lambda i: (sign * float(history[i].get(metric, 0)), i))
    return dict(history[best])


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
    report: str  # str(step.report()): the compile-time facts of the scheme (report.txt)
    notes: list[str]
    wall_s: float
    compile_s: float
    step_s: float  # mean seconds per training step in this invocation
    train_examples: int
    val_examples: int
    labels: tuple[str, ...]
    inputs: str  # what one example is: "128 tokens", "3x64x64 images"
    step: CompiledStep = field(repr=False)
    trained_params: int = 0  # elements the scheme trains
    total_params: int = 0  # elements full backprop would train
    planned_peak_bytes: int = 0  # the step's static memory plan
    peak_rss_bytes: int = 0  # the whole process's peak RSS, measured at the end
    test: dict[str, float] = field(default_factory=dict)  # --test-fraction: final weights
    auto_scheme: dict[str, Any] | None = None  # --scheme auto: what was chosen and why
    scheme_lines: list[str] = field(default_factory=list)  # the same, for the screen

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
    def report_path(self) -> Path:
        return self.out / REPORT

    @property
    def final(self) -> dict[str, Any]:
        """The last validation row (empty before the first epoch ends)."""
        return dict(self.history[-1]) if self.history else {}

    @property
    def best(self) -> dict[str, Any]:
        """The best validation row (``best_row``; empty before the first epoch ends)."""
        return best_row(self.history)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "out": str(self.out),
            "steps": self.steps,
            "total_steps": self.total_steps,
            "epochs_done": self.epochs_done,
            "stopped": self.stopped,
            "final": self.final,
            "best": self.best,
            "history": self.history,
            "notes": self.notes,
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "step_s": self.step_s,
            "train_examples": self.train_examples,
            "val_examples": self.val_examples,
            "labels": list(self.labels),
            "inputs": self.inputs,
            "trained_params": self.trained_params,
            "total_params": self.total_params,
            "planned_peak_bytes": self.planned_peak_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "test": self.test,
            "auto_scheme": self.auto_scheme,
        }

    def summary(self) -> str:
        """The run on one screen (the compile-time report is ``report_path``)."""
        lines = [self._headline(), self._setup()]
        lines += self.scheme_lines
        lines += [f"  data: {note}" for note in self.notes]
        lines += [self._validation(), *self._test(), self._timing(), self._memory()]
        lines += _files(self.out)
        return "\n".join(lines)

    def _headline(self) -> str:
        c = self.config
        state = "finished" if self.finished else f"stopped ({self.stopped})"
        line = (
            f"fine-tune {c.recipe or c.model}: {state} at step {self.steps}/{self.total_steps} "
            f"({self.epochs_done}/{c.epochs} epochs) in {self.wall_s:.1f} s"
        )
        return line if self.finished else f"{line}; continue it with --resume"

    def _setup(self) -> str:
        c = self.config
        pct = 100 * self.trained_params / max(self.total_params, 1)
        share = f" of {self.total_params:,} ({pct:.3g}%)" if self.total_params else ""
        return (
            f"  scheme {c.scheme}: {self.trained_params:,}{share} "
            f"params trained\n  {c.optimizer} lr {c.lr:g} (warmup {c.warmup:g}, then linear "
            f"decay), batch {c.batch_size} x {self.inputs}, backend {c.backend}"
        )

    def _validation(self) -> str:
        if not self.history:
            return "  validation: none yet (the run stopped before the first epoch's end)"
        final, best = self.final, self.best
        metric = primary_metric(final)
        name = metric.removeprefix("val_")
        loss = f"; loss {final['val_loss']:.4f}" if metric != "val_loss" else ""
        return (
            f"  validation {name} ({self.val_examples} examples): final {final[metric]:.4f} "
            f"(epoch {final['epoch']}), best {best[metric]:.4f} (epoch {best['epoch']}){loss}"
        )

    def _test(self) -> list[str]:
        """The test split's line (``--test-fraction``), if the run held one out."""
        if not self.test:
            return []
        shown = ", ".join(f"{k.removeprefix('test_')} {v:.4f}" for k, v in self.test.items())
        return [f"  test (held out from everything): {shown}"]

    def _timing(self) -> str:
        batch = self.config.batch_size or 0
        rate = batch / self.step_s if self.step_s else 0.0
        return (
            f"  time: {self.wall_s:.1f} s in all, compile {self.compile_s:.1f} s, "
            f"{self.step_s:.3f} s a step ({rate:.1f} examples/s)"
        )

    def _memory(self) -> str:
        rss = f"{self.peak_rss_bytes / _MIB:.0f} MiB" if self.peak_rss_bytes else "not measured"
        return (
            f"  memory: peak RSS {rss} (the whole process), "
            f"planned peak of the step {self.planned_peak_bytes / _MIB:.1f} MiB"
        )


def _files(out: Path) -> list[str]:
    """The run folder's files (hidden ones aside), the known ones first, described."""
    present = (
        sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
    )
    ordered = [n for n in _FILES if n in present] + [n for n in present if n not in _FILES]
    width = max((len(n) for n in ordered), default=0) + 3
    lines = [f"  files in {out}:"]
    for name in ordered:
        shown = name + "/" if (out / name).is_dir() else name
        lines.append(f"    {shown:<{width}}{_FILES.get(name, '')}".rstrip())
    return lines
