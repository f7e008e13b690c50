"""The resident memory of a fine-tune and of its compile child, moment by moment.

``run_memory.py`` shows one process's phases (and imports torch first, for its hooks);
this runs ``pockengine finetune ARGS`` (this checkout's code; ``--out`` a temporary folder unless
given) untouched in a child and samples, every
``--interval`` seconds, the resident memory (``VmRSS``) of that process and of each
process below it (``/proc/PID/task/*/children``). It reports the peak of their sum (what
the machine holds at once), the fine-tune process's peak while it has a child (with
``--compile-in child``: while the child compiles) and otherwise, and the children's peak,
and each child's own peak by the module it runs (``compile_child``: the compile, and
``--scheme auto``'s analysis before it; until session 15 the analysis ran in a child of
its own, ``auto_child``). A sample can miss a peak shorter than the
interval. Linux only (``/proc``)::

    OMP_NUM_THREADS=1 python benchmarks/tree_memory.py -- --max-steps 3 --max-val 32
    OMP_NUM_THREADS=1 python benchmarks/tree_memory.py -- --max-steps 3 --max-val 32 \\
        --compile-in process
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _harness import ROOT, child_env

__all__ = ["TreePeaks", "main", "measure"]

_MIB = 1 << 20


@dataclass
class TreePeaks:
    """Peaks in MiB: the sum over the tree, the top process with and without a child
    running, and the children's sum."""

    total: float = 0.0
    parent_with_child: float = 0.0
    parent_alone: float = 0.0
    children: float = 0.0
    by_child: dict[str, float] = field(default_factory=dict)  # module name -> its peak


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process ended between two reads
        pass
    return 0


def _module(pid: int) -> str:
    """What a child runs: the last part of ``-m MODULE``, else its program's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return "?"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(argv[0]).name


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        try:
            tasks = list(Path(f"/proc/{stack.pop()}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                kids = []
            found += kids
            stack += kids
    return found


def measure(args: Sequence[str], interval: float) -> TreePeaks:
    """Run ``pockengine finetune ARGS`` and sample its tree until it exits."""
    command = [sys.executable, "-m", "pockengine", "finetune", *args]
    peaks = TreePeaks()
    env = child_env(None, {"PYTHONPATH": str(ROOT)})
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL) as run:
        while run.poll() is None:
            parent = _rss(run.pid) / _MIB
            kids = _descendants(run.pid)
            rss = {k: _rss(k) / _MIB for k in kids}
            children = sum(rss.values())
            for k, mib in rss.items():
                name = _module(k) if mib else ""  # an exiting child has no cmdline
                if name:
                    peaks.by_child[name] = max(peaks.by_child.get(name, 0.0), mib)
            peaks.total = max(peaks.total, parent + children)
            peaks.children = max(peaks.children, children)
            if kids:
                peaks.parent_with_child = max(peaks.parent_with_child, parent)
            else:
                peaks.parent_alone = max(peaks.parent_alone, parent)
            time.sleep(interval)
    if run.returncode:
        raise SystemExit(f"pockengine finetune exited with {run.returncode}")
    return peaks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("finetune_args", nargs=argparse.REMAINDER,
                        help="after --: pockengine finetune's options")  # fmt: skip
    options = parser.parse_args(argv)
    args = [a for a in options.finetune_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="tree-memory-") as folder:
        out = [] if "--out" in args else ["--out", str(Path(folder) / "run")]
        peaks = measure([*args, *out], options.interval)
    by_child = {k: round(v) for k, v in peaks.by_child.items()}
    print(json.dumps({**{k: round(v) for k, v in asdict(peaks).items() if k != "by_child"},
                      "by_child": by_child}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
