"""SmolLM2-135M from the shipped Q4_1 GGUF, 4 x 128 tokens, LoRA on q/v (or ``--scheme``,
``--optimizer-state``): the stand-alone C trainer against the torch backend's step.

Case ``c``: ``pockengine export --recipe smollm2-pydocs --scheme lora --frozen-dtype gguf
--backend c --target c`` (with ``--remat-budget`` when given), ``make NATIVE=1 STATIC=1
SMALL=1`` (one thread), then ``./train`` over the written batches under ``/usr/bin/time
-v``: whole-process peak (max RSS), the trainer's mean step time (steps after the first),
tokens per second, the plan, the losses. Case ``torch``: the same recipe's step compiled
on the torch backend (``--frozen-dtype gguf``, one thread), the same batches: median step
time after the first, tokens per second, whole-process peak, losses. Each case runs in its
own process.

    PYTHONPATH=$PWD python benchmarks/c_smollm2_trainer.py --steps 4 \
        [--remat-budget 190MB] [--scheme sparse --optimizer-state int8] \
        [--out benchmarks/results/c_smollm2_trainer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TOKENS = 4 * 128
_EXPORT = ["--recipe", "smollm2-pydocs", "--frozen-dtype", "gguf", "--batch-size", "4",
           "--seq-len", "128"]  # fmt: skip


def _c_case(steps: int, budget: str | None, work: Path, extra: list[str]) -> dict[str, Any]:
    folder = work / "trainer"
    extra = [*extra, *(["--remat-budget", budget] if budget else [])]
    subprocess.run([sys.executable, "-m", "pockengine", "export", *_EXPORT, *extra,
                    "--backend", "c", "--target", "c", "--write-batches", str(steps),
                    "-o", str(folder)], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["make", "-s", "-C", str(folder), "NATIVE=1", "STATIC=1", "SMALL=1"],
                   check=True, capture_output=True)  # fmt: skip
    run = subprocess.run(["/usr/bin/time", "-v", "./train", "batches/batch.0.npy"], cwd=folder,
                         capture_output=True, text=True, check=True)  # fmt: skip
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    mean = re.search(r"mean step time ([\d.]+) ms", run.stderr)
    plan = re.search(r"planned peak [^*]*", (folder / "step.c").read_text()[:2000])
    step_s = float(mean[1]) / 1000 if mean else float("nan")
    return {
        "case": "c", "remat_budget": budget, "peak_mib": int(peak[1]) / 1024 if peak else None,
        "step_s": step_s, "tokens_per_s": TOKENS / step_s,
        "plan": plan[0].strip() if plan else None,
        "state_mib": (folder / "state.safetensors").stat().st_size / 2**20,
        "losses": [float(ln.split()[-1]) for ln in run.stdout.splitlines()
                   if ln.startswith("step ")],
    }  # fmt: skip


def _torch_case(steps: int, budget: str | None, extra: list[str]) -> dict[str, Any]:
    import torch

    from pockengine import cli, export_cli

    torch.set_num_threads(1)
    extra = [*extra, *(["--remat-budget", budget] if budget else [])]
    args = cli.build_parser().parse_args(["export", *_EXPORT, *extra, "--backend", "torch"])
    prepared = export_cli._from_args(args)
    step = prepared.step
    from pockengine.tasks import data as ds

    size = 4
    rows = ds.epoch_order(len(prepared.train[0]), prepared.config.seed, 0)[: steps * size]
    stacked = [np.ascontiguousarray(a[rows]).reshape(steps, size, *a.shape[1:])
               for a in prepared.train]  # fmt: skip
    batches = [tuple(a[i] for a in stacked) for i in range(steps)]
    losses, times = [], []
    for batch in batches:
        start = time.perf_counter()
        losses.append(float(step(*batch)))
        times.append(time.perf_counter() - start)
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM"))
    step_s = float(np.median(times[1:])) if len(times) > 1 else times[0]
    return {"case": "torch", "remat_budget": budget, "peak_mib": peak / 1024,
            "step_s": step_s, "tokens_per_s": TOKENS / step_s, "losses": losses}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--remat-budget")
    ap.add_argument("--scheme", default="lora")
    ap.add_argument("--optimizer-state", default="float32")
    ap.add_argument("--cases", nargs="+", default=["c", "torch"])
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.case:
        extra = ["--scheme", args.scheme, "--optimizer-state", args.optimizer_state]
        with tempfile.TemporaryDirectory() as tmp:
            result = (_c_case(args.steps, args.remat_budget, Path(tmp), extra)
                      if args.case == "c"
                      else _torch_case(args.steps, args.remat_budget, extra))  # fmt: skip
        result.update(scheme=args.scheme, optimizer_state=args.optimizer_state)
        print(json.dumps(result), flush=True)
        return
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for case in args.cases:
        cmd = [
            sys.executable,
            __file__,
            "--case",
            case,
            "--steps",
            str(args.steps),
            "--scheme",
            args.scheme,
            "--optimizer-state",
            args.optimizer_state,
        ]
        if args.remat_budget:
            cmd += ["--remat-budget", args.remat_budget]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
