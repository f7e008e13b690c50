"""What the benchmark scripts share: a case in a child process that prints its result as
one JSON line, the process's own peak RSS, the usual options, and the results written as
JSON and as a Markdown section between markers.

Standard library only: ``ort_training_peer.py`` imports it inside its own venv too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS",
    "ROOT",
    "SHAPES",
    "ChildFailedError",
    "add_data_options",
    "add_run_options",
    "child_env",
    "extract_kernels",
    "forward",
    "out_file",
    "reset_peak",
    "run_cases",
    "run_child",
    "steps_in_turn",
    "trainer_step_seconds",
    "utc_now",
    "vm_kib",
    "vm_mib",
    "write_out",
    "write_results",
    "write_section",
]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHAPES = ("seq_len", "image_size", "epochs", "batch_size")  # finetune's shape options
KERNELS = "pockengine/backends/c/kernels"


def out_file(text: str) -> Path:
    """``--out``'s argparse type: a file to write the results to, checked before the run
    (not a folder, in a folder that exists), so a typo costs no measurement."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no folder {path.parent}")
    return path


def write_out(path: Path, payload: Any) -> None:
    """``payload`` as JSON at ``path``, written aside and renamed, following no link
    (``pockengine.safe_write``); a refused write exits with one message."""
    from pockengine.ir import PockEngineError
    from pockengine.safe_write import write_json

    try:
        write_json(path, payload, indent=1)
    except (OSError, PockEngineError) as exc:
        sys.exit(f"error: --out {path}: {exc}")


def extract_kernels(rev: str, folder: Path) -> None:
    """The C backend's kernel files at git revision ``rev`` into ``folder``; exits with a
    message where ``rev`` names no revision with that folder."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], cwd=ROOT,
                            capture_output=True, text=True, check=False)  # fmt: skip
    if listed.returncode != 0:
        sys.exit(f"error: --rev {rev}: no {KERNELS} there ({listed.stderr.strip()})")
    names = listed.stdout.split()
    for name in names:
        data = subprocess.run(["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=ROOT,
                              capture_output=True, check=True).stdout  # fmt: skip
        (folder / name).write_bytes(data)


# -- the stand-alone C trainer's report ------------------------------------------------------


def steps_in_turn(
    steps: Mapping[str, Callable[..., Any]], batch: Sequence[Any], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """Each of ``steps`` called on ``batch`` in turn, ``rounds + 1`` times (the first a
    warm-up, kept): the process CPU seconds, wall seconds and losses of each call, by
    name."""
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    wall: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds + 1):
        for tag, step in steps.items():
            c0, w0 = time.process_time(), time.perf_counter()
            losses[tag].append(float(step(*batch)))
            cpu[tag].append(time.process_time() - c0)
            wall[tag].append(time.perf_counter() - w0)
    return cpu, wall, losses


def trainer_step_seconds(stderr: str) -> tuple[float, float]:
    """The median wall-clock and process CPU seconds of ``./train``'s steps after the first
    (the first alone when it ran one), from its ``step K time W s cpu C s`` lines."""
    found = re.findall(r"^step \d+ time ([\d.]+) s cpu ([\d.]+) s$", stderr, re.MULTILINE)
    if not found:
        raise SystemExit(f"./train reported no step times:\n{stderr[-2000:]}")
    timed = found[1:] or found
    wall = statistics.median(float(w) for w, _ in timed)
    cpu = statistics.median(float(c) for _, c in timed)
    return wall, cpu


# -- the process's own memory ------------------------------------------------------------


def vm_kib(field: str) -> int:
    """``field`` of /proc/self/status in KiB (``VmRSS``: resident now, ``VmHWM``: the peak
    since start or since ``reset_peak``); 0 where the kernel does not report it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def vm_mib(field: str) -> float:
    """``vm_kib`` in MiB; NaN where the kernel does not report the field."""
    kib = vm_kib(field)
    return kib / 1024 if kib else float("nan")


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0: ``clear_refs`` 5); where the
    kernel refuses, the peak keeps counting from the process's start."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


# -- a case in its own process -----------------------------------------------------------


class ChildFailedError(RuntimeError):
    """A child process exited non-zero; ``stderr`` holds what it wrote there."""

    def __init__(self, argv: Sequence[str], stderr: str) -> None:
        lines = stderr.strip().splitlines()
        self.stderr = stderr
        self.last_line = lines[-1] if lines else "failed"
        super().__init__(f"{' '.join(argv)}: {self.last_line}")


def child_env(threads: int | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: offline Hugging Face, and with ``threads``,
    that many threads in every BLAS/OpenMP pool, so cases compare at the same width."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra or {})}
    if threads is not None:
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[key] = str(threads)
    return env


def run_child(
    argv: Sequence[object],
    threads: int | None = None,
    *,
    cwd: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``python *argv`` (each item as a string) in a fresh process, whose peak RSS is its
    own, and return the JSON object on the last line of its stdout. Raises
    ``ChildFailedError`` on a non-zero exit."""
    cmd = [sys.executable, *map(str, argv)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads, extra_env),
                          cwd=cwd, check=False)  # fmt: skip
    if done.returncode != 0:
        raise ChildFailedError(cmd, done.stderr)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run_cases(cases: Iterable[str], run: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """``run(case)`` for each case in turn, each row echoed to stderr as it comes."""
    rows = []
    for case in cases:
        rows.append(run(case))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# -- options -----------------------------------------------------------------------------


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def forward(args: argparse.Namespace, keys: Iterable[str]) -> list[str]:
    """``--key value`` for each of ``keys`` that ``args`` sets (not None): the options a
    parent passes on to its children, or prints as the command that reproduces a table."""
    out: list[str] = []
    for key in keys:
        value = getattr(args, key)
        if value is not None:
            out += [_flag(key), str(value)]
    return out


def add_data_options(
    parser: argparse.ArgumentParser,
    *,
    max_train: int | None,
    max_val: int | None,
    shapes: Sequence[str] = SHAPES,
) -> None:
    """``--max-train``, ``--max-val`` and the shape options (integers; a shape left out
    takes the recipe's default)."""
    parser.add_argument("--max-train", type=int, default=max_train)
    parser.add_argument("--max-val", type=int, default=max_val)
    for key in shapes:
        parser.add_argument(_flag(key), type=int)


def add_run_options(
    parser: argparse.ArgumentParser, *, threads: int, seed: bool = True, child: bool = True
) -> None:
    """``--threads``, ``--seed`` and the hidden ``--child CASE`` a parent runs itself with."""
    parser.add_argument("--threads", type=int, default=threads)
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    if child:
        parser.add_argument("--child", help=argparse.SUPPRESS)


# -- results -----------------------------------------------------------------------------


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def write_results(name: str, payload: Any, *, indent: int = 2) -> Path:
    """``payload`` as benchmarks/results/<name>.json; its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=indent) + "\n")
    return path


def write_section(
    path: Path, markers: tuple[str, str], body: str, *, title: str, heading: str | None = None
) -> None:
    """``body`` between the ``markers`` of the Markdown file ``path`` (what stood there
    before is replaced). Where they are missing, they are appended, under ``heading`` if
    given; a missing file starts as ``# title``."""
    start, end = markers
    text = path.read_text() if path.exists() else f"# {title}\n"
    if start not in text or end not in text:
        section = f"{heading}\n\n" if heading else ""
        text = text.rstrip() + f"\n\n{section}{start}\n{end}\n"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")
