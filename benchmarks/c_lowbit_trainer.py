"""The stand-alone C trainer on low-bit frozen weights: whole-process peak and step time.

For each ``--frozen-dtype`` (none, int8, int4) the benchmark LLaMA workload (``zoo``'s
``llama``: 8 blocks, hidden 512, vocabulary 32000, 1 x 256 tokens, untied head) with LoRA
r8 on q/v is exported with ``step.export(folder, target="c")``, built with ``make NATIVE=1
STATIC=1 SMALL=1`` and run as ``./train`` for a few steps under ``/usr/bin/time -v``; each
case is its own process. Prints one JSON line per case: the plan's arena and state bytes,
the whole-process peak (max RSS), the mean step time the trainer reports, the losses.

    python benchmarks/c_lowbit_trainer.py --steps 3 [--dtypes none int4] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _case(frozen_dtype: str, steps: int, workdir: Path) -> dict[str, Any]:
    import pockengine as pe
    from pockengine import zoo

    w = zoo.BENCHMARKS["llama"]()
    scheme = pe.schemes.lora(rank=8, alpha=16, targets=["*q_proj", "*v_proj"])
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme, backend="numpy",
                      optimizer=pe.optim.AdamW(lr=1e-4),
                      frozen_dtype=None if frozen_dtype == "none" else frozen_dtype)  # fmt: skip
    state = sum(v.type.nbytes for v in step.graph.inputs if v.role is not None
                and v.role.name != "INPUT")  # fmt: skip
    folder = step.export(workdir / frozen_dtype, target="c")
    ids = np.stack([w.make_batch(i)[0].numpy() for i in range(steps)])
    np.save(folder / "ids.npy", ids)
    subprocess.run(["make", "-s", "-C", str(folder), "NATIVE=1", "STATIC=1", "SMALL=1"],
                   check=True)  # fmt: skip
    run = subprocess.run(["/usr/bin/time", "-v", "./train", "ids.npy"], cwd=folder,
                         capture_output=True, text=True, check=True)  # fmt: skip
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)[1])  # type: ignore[index]
    mean = re.search(r"([\d.]+) ms", run.stderr)
    losses = [float(ln.split()[-1]) for ln in run.stdout.splitlines() if ln.startswith("step ")]
    arena = re.search(r"arena ([\d.]+) MiB", (folder / "step.c").read_text()[:2000])
    return {
        "frozen_dtype": frozen_dtype,
        "arena_mib": float(arena[1]) if arena else None,  # the exported step's plan
        "state_mib": state / 2**20,
        "peak_mib": peak / 1024,
        "step_ms": float(mean[1]) if mean else None,
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--out", help="a JSON file for the results")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            results.append(_case(dtype, args.steps, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
