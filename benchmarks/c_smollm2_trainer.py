"""SmolLM2-135M from the shipped Q4_1 GGUF, 4 x 128 tokens, LoRA on q/v (or ``--scheme``,
``--optimizer-state``): the stand-alone C trainer against the torch backend's step.

Case ``c``: ``pockengine export --recipe smollm2-pydocs --scheme lora --frozen-dtype gguf
--backend c --target c`` (with ``--remat-budget`` when given), ``make NATIVE=1 STATIC=1
SMALL=1`` (one thread), then ``./train`` over the written batches under ``/usr/bin/time
-v``: whole-process peak (max RSS), the trainer's median step time (steps after the
first), tokens per second, the plan, the losses. Case ``torch``: the same recipe's step compiled
on the torch backend (``--frozen-dtype gguf``, one thread), the same batches: median step
time after the first, tokens per second, whole-process peak, losses. Each case runs in its
own process. Beside the wall-clock figures, each case reports its CPU time a step
(``cpu_step_s``, ``cpu_tokens_per_s``), which a loaded machine disturbs less. Both cases
give medians over the steps after the first: the torch step timed around each call,
``./train`` from the wall-clock and process CPU time it reports for each step.
``--keep DIR`` exports case ``c``'s trainer into ``DIR/trainer`` and keeps it (to run
``perf`` on).

``--eval K``: after the run, the validation perplexity (exp of the mean next-token loss) of
both on the first K batches (8 sequences each) of the recipe's validation split, through
the compiled evaluator a fine-tune run uses (``pockengine.tasks.metrics``): case ``c``
runs ``./train --save`` and loads the saved trained state into the recipe's step compiled
on the torch backend (also reporting the untrained perplexity), case ``torch`` evaluates
its own step after its steps; a last line gives both and their ratio. With both cases, a
line gives ./train's tokens per second over the torch step's (wall clock and CPU time).

    PYTHONPATH=$PWD python benchmarks/c_smollm2_trainer.py --steps 4 \
        [--remat-budget 190MB [--torch-remat-budget recipe]] \
        [--scheme sparse --optimizer-state int8] [--eval 4] \
        [--out benchmarks/results/c_smollm2_trainer.json]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from _harness import trainer_step_seconds

TOKENS = 4 * 128
_EXPORT = ["--recipe", "smollm2-pydocs", "--frozen-dtype", "gguf", "--batch-size", "4",
           "--seq-len", "128"]  # fmt: skip


def _step_and_task(extra: list[str], backend: str) -> tuple[Any, Any, Any]:
    """The recipe's step (as ``pockengine export`` with these options compiles it), its
    task and its config."""
    from pockengine import cli
    from pockengine.finetune.cli import config_from_args
    from pockengine.finetune.running import trainer
    from pockengine.tasks import recipes

    args = cli.build_parser().parse_args(["export", *_EXPORT, *extra, "--backend", backend])
    args.optimizer = args.optimizer or "adamw"
    config = config_from_args(args).validate()
    config = config.with_defaults(recipes.defaults(config, auto=False)).validate()
    assert config.scheme is not None, "filled in by the recipe's defaults"
    scheme = recipes.parse_scheme(config.scheme, recipes.recipe_name(config), config.batchnorm)
    task = recipes.build(config)
    return trainer.compile_task(config, task, scheme), task, config


def _perplexity(step: Any, task: Any, batches: int) -> float:
    """Validation perplexity of the step's current values on the first ``batches``
    evaluation batches of the task's validation split."""
    from pockengine.tasks import metrics

    held_out = dataclasses.replace(
        task, val=tuple(a[: batches * metrics.CAUSAL_LM_BATCH] for a in task.val)
    )
    evaluator = metrics.compile_evaluator(step, held_out)
    return float(metrics.evaluate(step, held_out, evaluator=evaluator)["val_perplexity"])


def _load_trainer_state(step: Any, path: Path) -> None:
    """The trained params (model names) and optimizer state (IR names) ``./train --save``
    wrote, into ``step``."""
    from pockengine.backends.c.export import read_safetensors

    saved = read_safetensors(path)
    names = set(step.state_names)
    params = {n: a for n, a in saved.items() if n in names}
    missing = set(step.trained) - set(params)
    if missing:
        raise SystemExit(f"{path}: no value for the trained {sorted(missing)[:3]}")
    result = step.load_state(params, strict=False)
    if result.unexpected or result.mismatched:
        raise SystemExit(f"{path}: {result.describe()}")
    step.load_state(optimizer={n: a for n, a in saved.items() if n not in names})


def _c_case(
    steps: int, budget: str | None, work: Path, extra: list[str], evals: int = 0
) -> dict[str, Any]:
    folder = work / "trainer"
    extra = [*extra, *(["--remat-budget", budget] if budget else [])]
    subprocess.run([sys.executable, "-m", "pockengine", "export", *_EXPORT, *extra,
                    "--backend", "c", "--target", "c", "--write-batches", str(steps),
                    "-o", str(folder)], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["make", "-s", "-C", str(folder), "NATIVE=1", "STATIC=1", "SMALL=1"],
                   check=True, capture_output=True)  # fmt: skip
    save = ["--save", "trained.safetensors"] if evals else []
    run = subprocess.run(["/usr/bin/time", "-v", "./train", *save, "batches/batch.0.npy"],
                         cwd=folder, capture_output=True, text=True, check=True)  # fmt: skip
    step_s, cpu_step_s = trainer_step_seconds(run.stderr)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    plan = re.search(r"planned peak [^*]*", (folder / "step.c").read_text()[:2000])
    quality: dict[str, float] = {}
    if evals:
        import torch

        torch.set_num_threads(1)
        step, task, _ = _step_and_task(extra, "torch")
        quality["untrained_perplexity"] = _perplexity(step, task, evals)
        _load_trainer_state(step, folder / "trained.safetensors")
        quality["val_perplexity"] = _perplexity(step, task, evals)
    return {
        **quality,
        "case": "c", "remat_budget": budget, "peak_mib": int(peak[1]) / 1024 if peak else None,
        "step_s": step_s, "tokens_per_s": TOKENS / step_s,
        "cpu_step_s": cpu_step_s, "cpu_tokens_per_s": TOKENS / cpu_step_s,
        "plan": plan[0].strip() if plan else None,
        "state_mib": (folder / "state.safetensors").stat().st_size / 2**20,
        "losses": [float(ln.split()[-1]) for ln in run.stdout.splitlines()
                   if ln.startswith("step ")],
    }  # fmt: skip


def _torch_case(steps: int, budget: str | None, extra: list[str], evals: int = 0) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    extra = [*extra, *(["--remat-budget", budget] if budget else [])]
    step, task, config = _step_and_task(extra, "torch")
    from pockengine.tasks import data as ds

    size = 4
    rows = ds.epoch_order(len(task.train[0]), config.seed, 0)[: steps * size]
    stacked = [np.ascontiguousarray(a[rows]).reshape(steps, size, *a.shape[1:])
               for a in task.train]  # fmt: skip
    batches = [tuple(a[i] for a in stacked) for i in range(steps)]
    losses, times, cpu = [], [], []
    for batch in batches:
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(float(step(*batch)))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM"))
    step_s = float(np.median(times[1:])) if len(times) > 1 else times[0]
    cpu_step_s = float(np.median(cpu[1:])) if len(cpu) > 1 else cpu[0]
    quality = {"val_perplexity": _perplexity(step, task, evals)} if evals else {}
    return {**quality, "case": "torch", "remat_budget": budget, "peak_mib": peak / 1024,
            "step_s": step_s, "tokens_per_s": TOKENS / step_s, "cpu_step_s": cpu_step_s,
            "cpu_tokens_per_s": TOKENS / cpu_step_s, "losses": losses}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--remat-budget")
    ap.add_argument("--torch-remat-budget", metavar="BUDGET",
                    help="the torch case's budget when it differs from --remat-budget "
                         "('recipe': the recipe's own)")  # fmt: skip
    ap.add_argument("--scheme", default="lora")
    ap.add_argument("--optimizer-state", default="float32")
    ap.add_argument("--cases", nargs="+", default=["c", "torch"])
    ap.add_argument("--eval", type=int, default=0, metavar="K",
                    help="validation perplexity of both on K held-out batches")  # fmt: skip
    ap.add_argument("--keep", metavar="DIR",
                    help="export case c's trainer into DIR/trainer, kept (to profile)")  # fmt: skip
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.case:
        extra = ["--scheme", args.scheme, "--optimizer-state", args.optimizer_state]
        with tempfile.TemporaryDirectory() as tmp:
            budget, evals = args.remat_budget, args.eval
            work = Path(args.keep) if args.keep else Path(tmp)
            result = (_c_case(args.steps, budget, work, extra, evals)
                      if args.case == "c"
                      else _torch_case(args.steps, budget, extra, evals))  # fmt: skip
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
        budget = args.remat_budget
        if case == "torch" and args.torch_remat_budget:
            budget = None if args.torch_remat_budget == "recipe" else args.torch_remat_budget
        if budget:
            cmd += ["--remat-budget", budget]
        if args.eval:
            cmd += ["--eval", str(args.eval)]
        if args.keep:
            cmd += ["--keep", str(Path(args.keep).resolve())]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    speed = {r["case"]: r for r in results}
    if {"c", "torch"} <= set(speed):
        ratio = {k: speed["c"][k] / speed["torch"][k] for k in ("tokens_per_s", "cpu_tokens_per_s")}
        results.append({"case": "speed ratio (./train / torch)", **ratio})
        print(json.dumps(results[-1]), flush=True)
    ppl = {r["case"]: r["val_perplexity"] for r in results if "val_perplexity" in r}
    if len(ppl) == 2:
        results.append({"case": "perplexity", "eval_batches": args.eval, "c": ppl["c"],
                        "torch": ppl["torch"], "ratio": ppl["c"] / ppl["torch"]})  # fmt: skip
        print(
            f"validation perplexity, {args.eval} batches: ./train {ppl['c']:.4f}  "
            f"torch {ppl['torch']:.4f}  ratio {ppl['c'] / ppl['torch']:.5f}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
