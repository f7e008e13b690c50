"""Where a fine-tune's memory goes: resident memory phase by phase, in a child process.

Runs ``pockengine finetune`` (the default ``minilm-bbc`` sparse recipe unless other
arguments are given) in a fresh child process, with hooks at the phase boundaries: the
dataset read, the model and tokenizer loads, the encoding, the compile, each training
step, the checkpoint, each validation pass, the best weights kept and the end of the run.
At each boundary the child reads its resident memory (``VmRSS``, split into anonymous and
file-backed pages) and the peak since the previous boundary (``VmHWM``, which it then
resets through ``/proc/self/clear_refs``), so each row's peak belongs to that phase
alone. Linux only (``/proc``)::

    OMP_NUM_THREADS=1 python benchmarks/run_memory.py -- --max-steps 3 --max-val 32
    python benchmarks/run_memory.py --json out.json -- --recipe minilm-bbc --max-steps 3

The hooks wrap module functions and methods from outside the package (no change to what
the run does); only the first ``--steps-shown`` steps get rows of their own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _harness import ROOT, reset_peak, run_child, vm_kib

__all__ = ["Phase", "PhaseLog", "main", "measure"]

_KIB = 1024
_MIB = 1 << 20
_STEPS_SHOWN = 2


@dataclass(frozen=True)
class Phase:
    """One stretch of the run: its name, its peak resident memory, the resident memory at
    its end (anonymous and file-backed parts), in bytes."""

    name: str
    peak: int
    rss: int
    anon: int
    file: int


class PhaseLog:
    """Closes a phase at each ``mark``: its peak since the previous mark, then resets it."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        reset_peak()

    def mark(self, name: str) -> None:
        peak, rss, anon = (vm_kib(f) * _KIB for f in ("VmHWM", "VmRSS", "RssAnon"))
        file = (vm_kib("RssFile") + vm_kib("RssShmem")) * _KIB
        self.phases.append(Phase(name, peak, rss, anon, file))
        reset_peak()

    def around(self, owner: Any, attr: str, name: str, limit: int | None = None) -> None:
        """Wrap ``owner.attr`` so that what runs before it and what it does are phases of
        their own (``limit``: only its first calls get rows)."""
        inner: Callable[..., Any] = getattr(owner, attr)
        calls = [0]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            shown = limit is None or calls[0] <= limit
            label = name if limit is None else f"{name} {calls[0]}"
            if shown:
                self.mark(f"before {label}")
            try:
                return inner(*args, **kwargs)
            finally:
                if shown:
                    self.mark(label)

        setattr(owner, attr, wrapped)


# (module, attribute, phase name, rows for its first calls only): what the run's phases
# are. A hook whose function the code no longer has is left out.
_HOOKS: tuple[tuple[str, str, str, int | None], ...] = (
    ("pockengine.tasks.data", "load_folder", "read the dataset", None),
    ("pockengine.tasks.data", "load_dataset", "read the dataset", None),
    ("pockengine.tasks.models", "load_hf_encoder", "load the model", None),
    ("pockengine.tasks.models", "load_hf_tokenizer", "load the tokenizer", None),
    ("pockengine.tasks.data", "encode_hf", "encode", 2),
    ("pockengine.tasks.recipes", "build", "build the task", None),
    ("pockengine.finetune.compiling.task_step", "compile_task", "compile", None),
    ("pockengine.finetune.running.launch", "compile_in_child", "compile in a child", None),
    ("pockengine.finetune.running.trainer", "load_compiled", "load the step", None),
    ("pockengine.tasks.metrics", "compile_evaluator", "compile the evaluator", None),
    ("pockengine.finetune.running.loop", "Loop.save", "checkpoint", 1),
    ("pockengine.tasks.metrics", "evaluate", "evaluate", 1),
    ("pockengine.finetune.running.loop", "evaluate", "evaluate", None),  # the loop's own import
    ("pockengine.finetune.run_folder.best", "BestWeights.offer", "keep the best weights", None),
    (
        "pockengine.finetune.run_folder.home",
        "_load",
        "write the model: values into the module",
        None,
    ),
    (
        "pockengine.finetune.run_folder.home",
        "_quiet_save",
        "write the model: save_pretrained",
        None,
    ),
    ("pockengine.finetune.run_folder.home", "write_model", "write the model", None),
    ("pockengine.finetune.running.trainer", "write_from_skeleton", "write the model", None),
    ("pockengine.step.running", "CompiledStep.__call__", "step", None),  # limit: --steps-shown
)


def _install_hooks(log: PhaseLog, steps_shown: int) -> None:
    for module_name, path, name, limit in _HOOKS:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is not None and hasattr(owner, attr):
            log.around(owner, attr, name, steps_shown if name == "step" else limit)


def _child(args: Sequence[str], steps_shown: int) -> int:
    """Run the fine-tune here, with the hooks; the phases as the last line of stdout."""
    log = PhaseLog()
    log.mark("python")
    import torch  # noqa: F401 -- measured as a phase of its own

    log.mark("import torch")
    from pockengine.cli import main as cli_main

    log.mark("import pockengine.cli")
    _install_hooks(log, steps_shown)
    log.mark("import pockengine.finetune")
    code = cli_main(["finetune", *args])
    log.mark("the rest (steps not shown, evaluation, saving)")
    peak = max(p.peak for p in log.phases)
    print(json.dumps({"phases": [asdict(p) for p in log.phases], "peak": peak}), flush=True)
    return int(code or 0)


def _collapse(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Folds each ``before X`` phase into the phase before it when it added nothing."""
    rows: list[dict[str, Any]] = []
    for p in phases:
        if p["name"].startswith("before ") and rows and p["peak"] <= rows[-1]["peak"]:
            rows[-1] = {**p, "name": rows[-1]["name"], "peak": rows[-1]["peak"]}
            continue
        rows.append(p)
    return rows


def measure(args: Sequence[str], steps_shown: int = _STEPS_SHOWN) -> dict[str, Any]:
    """The phases of ``pockengine finetune ARGS`` run in a child process (its threads as
    this process's ``OMP_NUM_THREADS`` says)."""
    argv = [__file__, "--child", "--steps-shown", steps_shown, "--", *args]
    result = run_child(argv, extra_env={"PYTHONPATH": str(ROOT)})
    return {**result, "args": list(args)}


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'phase':<48} {'peak':>7} {'RSS after':>10} {'anon':>7} {'file':>7}  (MiB)"]
    for p in _collapse(result["phases"]):
        values = (p["peak"], p["rss"], p["anon"], p["file"])
        lines.append(f"{p['name']:<48} " + " ".join(f"{v / _MIB:>7.0f}" for v in values))
    lines.append(f"whole-process peak: {result['peak'] / _MIB:.0f} MiB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the phases here")
    parser.add_argument("--steps-shown", type=int, default=_STEPS_SHOWN)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("finetune_args", nargs="*", help="arguments of pockengine finetune")
    ns = parser.parse_args(argv)
    if ns.child:
        return _child(ns.finetune_args, ns.steps_shown)
    with tempfile.TemporaryDirectory(prefix="run_memory-") as tmp:
        args = ns.finetune_args
        if not any(a == "--out" or a.startswith("--out=") for a in args):
            args = [*args, "--out", tmp]  # a fresh run each time, not a resumed one
        result = measure(args, ns.steps_shown)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"pockengine finetune {' '.join(args)} (OMP_NUM_THREADS={threads})")
    print(_table(result))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
