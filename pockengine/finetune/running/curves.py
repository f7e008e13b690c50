"""Training curves: ``RUN/curves.png`` during a run, and ``pockengine plot`` after it.

A run's curves come from its ``metrics.jsonl``: the ``train`` lines (the mean loss of
each ``--log-every`` interval, drawn faint, and its exponential moving average, drawn
solid) and the ``eval`` lines (the validation metric: accuracy, or perplexity for a
causal LM), both against the training step. Each run's legend says its scheme, its
trained parameters and its peak memory (whole-process peak RSS beside the step's planned
peak), from ``summary.json`` or, during the run, from the trainer.

The picture is drawn on a ``matplotlib.figure.Figure`` (the Agg canvas, no pyplot, no
change to matplotlib's global backend) and written atomically, so a reader never sees a
half-written PNG. During a run ``CurvesWriter`` draws it in a child process at each
validation and at the end, so matplotlib adds nothing to the run's memory or time.
matplotlib is a dependency of pockengine; where it is missing a run skips the picture
with one log line, and ``pockengine plot`` says so.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pockengine.finetune.run_folder.checkpoint import write_atomic
from pockengine.finetune.run_folder.run_files import read_metric_rows, read_summary
from pockengine.ir import PockEngineError

__all__ = [
    "CURVES",
    "Curves",
    "CurvesWriter",
    "PlotError",
    "RunInfo",
    "ema",
    "plot_runs",
    "read_curves",
    "render",
    "write_curves",
]

log = logging.getLogger(__name__)

CURVES = "curves.png"
_MIB = 1 << 20
# Weight of the past in the loss's moving average (TensorBoard's "smoothing" slider).
SMOOTHING = 0.6
# The validation metric drawn, by preference: the first a run's eval lines hold.
_METRICS = ("val_accuracy", "val_perplexity", "val_loss")
_INSTALL = "pip install 'matplotlib>=3.8'"
_WARNED: set[str] = set()  # what this process has already said is missing


class PlotError(PockEngineError):
    """A plot that cannot be drawn: a folder that is not a run, matplotlib missing."""


@dataclass(frozen=True)
class RunInfo:
    """What a run's legend says about it (0: not known)."""

    name: str
    scheme: str = ""
    trained_params: int = 0
    peak_rss_bytes: int = 0
    planned_peak_bytes: int = 0

    @classmethod
    def from_summary(cls, name: str, summary: Mapping[str, Any]) -> RunInfo:
        """From a ``summary.json`` (older runs lack the memory fields: left at 0)."""
        config = summary.get("config", {})
        return cls(
            name=name,
            scheme=str(config.get("scheme") or ""),
            trained_params=int(summary.get("trained_params", 0)),
            peak_rss_bytes=int(summary.get("peak_rss_bytes", 0)),
            planned_peak_bytes=int(summary.get("planned_peak_bytes", 0)),
        )

    def label(self) -> str:
        parts = [self.name]
        if self.scheme:
            parts.append(f"scheme {self.scheme}")
        if self.trained_params:
            parts.append(f"{self.trained_params:,} trained params")
        if self.peak_rss_bytes:
            plan = f" (planned {_mib(self.planned_peak_bytes)})" if self.planned_peak_bytes else ""
            parts.append(f"peak RSS {_mib(self.peak_rss_bytes)}{plan}")
        return ", ".join(parts)


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB" if n < 10 * _MIB else f"{n / _MIB:.0f} MiB"


@dataclass(frozen=True)
class Curves:
    """One run's points: the logged training loss and the validation metric, by step."""

    info: RunInfo
    loss_steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_values: list[float] = field(default_factory=list)
    metric: str = ""  # "val_accuracy", "val_perplexity", "val_loss"; "" before any eval


def ema(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """The exponential moving average ``s_t = w s_(t-1) + (1 - w) x_t``, divided by
    ``1 - w^t`` so that its first points are not pulled towards zero."""
    out: list[float] = []
    s = 0.0
    for t, x in enumerate(values, start=1):
        s = weight * s + (1 - weight) * x
        out.append(s / (1 - weight**t))
    return out


def read_curves(run: Path, info: RunInfo | None = None) -> Curves:
    """A run folder's curves; ``info`` defaults to what its ``summary.json`` says."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"{run}: no metrics.jsonl; is it a pockengine finetune run folder?")
    if info is None:
        summary = run / "summary.json"
        info = RunInfo(run.name)
        if summary.is_file():
            info = RunInfo.from_summary(run.name, read_summary(summary))
    rows = read_metric_rows(metrics)
    train = [r for r in rows if r.get("event") == "train" and "loss" in r]
    evals = [r for r in rows if r.get("event") == "eval"]
    metric = next((m for m in _METRICS if evals and m in evals[-1]), "")
    evals = [r for r in evals if metric in r]
    return Curves(
        info=info,
        loss_steps=[int(r["step"]) for r in train],
        losses=[float(r["loss"]) for r in train],
        val_steps=[int(r["step"]) for r in evals],
        val_values=[float(r[metric]) for r in evals],
        metric=metric,
    )


def render(runs: Sequence[Curves], title: str = "") -> bytes:
    """The PNG of one or more runs: training loss (left), validation metric (right).
    Raises ``ImportError`` without matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    legend_inches = 0.2 * len(runs) + 0.3  # one legend line a run, under the plots
    fig = Figure(figsize=(11, 4 + legend_inches))
    loss_ax, val_ax = fig.subplots(1, 2, sharex=True)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for run, colour in zip(runs, colours, strict=True):
        loss_ax.plot(run.loss_steps, run.losses, color=colour, alpha=0.25, linewidth=1)
        few = len(run.losses) <= 30  # dots show where the few logged points are
        loss_ax.plot(
            run.loss_steps,
            ema(run.losses),
            color=colour,
            label=run.info.label(),
            marker="." if few else None,
        )
        val_ax.plot(run.val_steps, run.val_values, color=colour, marker="o", markersize=4)
    loss_title = f"training loss: logged (faint), moving average {SMOOTHING} (solid)"
    loss_ax.set(xlabel="step", ylabel="training loss", title=loss_title)
    metrics = sorted({r.metric for r in runs if r.metric})
    names = " / ".join(m.removeprefix("val_") for m in metrics) or "none yet"
    val_ax.set(xlabel="step", ylabel=f"validation {names}", title="validation")
    if metrics == ["val_perplexity"]:
        val_ax.set_yscale("log")
    for ax in (loss_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_ax.set_xlim(left=0)
    fig.legend(loc="lower center", ncols=1, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, legend_inches / (4 + legend_inches), 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def write_curves(run: Path, info: RunInfo) -> Path:
    """Rewrite ``run/curves.png`` atomically from its metrics (``ImportError`` without
    matplotlib, ``PlotError`` without metrics, ``OSError`` if it cannot be written)."""
    path = run / CURVES
    write_atomic(path, render([read_curves(run, info)], title=info.name))
    return path


class CurvesWriter:
    """Redraws a run's ``curves.png`` in a child process, while the run goes on.

    A child keeps matplotlib (about 35 MiB) out of the training process, whose peak RSS
    the run reports, and out of its time. One drawing at a time: ``update`` first waits
    for the previous one. A drawing that fails costs the run one log line, never the run;
    matplotlib missing is said once a process.
    """

    def __init__(self, run: Path) -> None:
        self.run = run
        self._child: subprocess.Popen[str] | None = None

    def update(self, info: RunInfo) -> None:
        """Start redrawing with ``info`` in the legend (returns at once)."""
        self.wait()
        if not (self.run / "metrics.jsonl").is_file():
            return  # nothing logged yet
        command = [sys.executable, "-m", __name__, str(self.run), json.dumps(asdict(info))]
        try:  # its own session: a Ctrl-C meant for the run does not kill the drawing
            self._child = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("%s not written: cannot start %s (%s)", CURVES, sys.executable, exc)

    def wait(self) -> Path | None:
        """Wait for the drawing under way; the picture, or ``None`` if it was not drawn."""
        child, self._child = self._child, None
        if child is None:
            return None
        _, err = child.communicate()
        if child.returncode == 0:
            return self.run / CURVES
        why = (err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        if child.returncode != _NO_MATPLOTLIB:
            log.warning("%s not written: %s", self.run / CURVES, why)
        elif CURVES not in _WARNED:
            log.warning("%s not written: matplotlib is missing (%s); %s", CURVES, why, _INSTALL)
            _WARNED.add(CURVES)
        return None


_NO_MATPLOTLIB = 3


def _main(argv: Sequence[str]) -> int:
    """The child of ``CurvesWriter``: ``python -m pockengine.finetune.running.curves RUN INFO``."""
    run, info = Path(argv[0]), RunInfo(**json.loads(argv[1]))
    try:
        write_curves(run, info)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return _NO_MATPLOTLIB
    except (OSError, PockEngineError) as exc:  # PlotError, RunFileError
        print(exc, file=sys.stderr)
        return 1
    return 0


def plot_runs(runs: Sequence[Path], out: Path) -> Path:
    """Overlay the curves of several run folders in one PNG at ``out``."""
    curves = [read_curves(Path(r)) for r in runs]
    try:
        png = render(curves)
    except ImportError as exc:
        raise PlotError(f"pockengine plot needs matplotlib: {_INSTALL}") from exc
    try:
        write_atomic(out, png)
    except OSError as exc:
        raise PlotError(f"cannot write {out}: {exc}") from exc
    return out


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
