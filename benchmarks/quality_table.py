"""Quality of each scheme on a held-out test split, over seeds: docs/quality.md.

For each recipe (and a generic ``--model/--data`` run) and each scheme (full, auto,
sparse, bias, head; lora when the scheme vocabulary has it; any other name, such as
``last:K``, with ``--schemes``):

1. the learning rate is chosen on the training split (``pockengine.scheme_choice.lr_choice``:
   short runs over ``--lr-grid``, scored on held-out *training* examples), once per
   recipe and scheme, with the first seed's split, in a child process;
2. ``pockengine finetune`` runs once per seed in its own process (so its peak RSS is
   its own: started from this small process, not one grown by an lr choice), with
   ``--test-fraction``: a seeded part of the validation split is a test split that
   neither the lr choice, the scheme search nor the keeping of the best epoch reads;
3. the test metric of the final weights (accuracy, or perplexity for the causal LM),
   mean and standard deviation over seeds, the step's planned peak and the measured
   whole-process peak RSS are written to ``benchmarks/results/quality_table-<tag>.json``
   and, as a table, between this tag's markers in ``docs/quality.md``.

The full run (every recipe at its defaults, three seeds) is the default; docs/quality.md
names the configurations its tables ran.

    python benchmarks/quality_table.py --recipes minilm-bbc --seeds 0 1 --max-train 480 \\
        --seq-len 64 --epochs 1 --tag reduced
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness import (
    ROOT,
    add_data_options,
    child_env,
    forward,
    utc_now,
    write_results,
    write_section,
)

DOC = ROOT / "docs" / "quality.md"
RECIPES = ("minilm-bbc", "minilm-tweets", "lite0-fashion", "smollm2-pydocs")
_MIB = float(1 << 20)
_SHAPES = ("epochs", "seq_len", "batch_size", "image_size")


def default_schemes() -> list[str]:
    from pockengine.sparse.schemes import SCHEME_NAMES

    return ["full", "auto", "sparse", "bias", "head", *(["lora"] if "lora" in SCHEME_NAMES else [])]


def _options(args: argparse.Namespace, scheme: str) -> list[str]:
    """The finetune options every run of this table shares (and auto's budget)."""
    out = forward(args, ("max_train", "max_val", *_SHAPES))
    out += ["--batchnorm", args.batchnorm] if args.batchnorm else []
    budget = getattr(args, "auto_budget", None)
    out += ["--memory-budget", budget] if budget and scheme == "auto" else []
    score = getattr(args, "auto_score", None)
    out += ["--auto-score", score] if score and scheme == "auto" else []
    return [*out, "--backend", args.backend, "--test-fraction", str(args.test_fraction)]


def _target(recipe: str, args: argparse.Namespace) -> list[str]:
    if recipe == "generic":
        return ["--model", args.model, "--data", args.data]
    return ["--recipe", recipe]


def choose_lr(recipe: str, scheme: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The scheme's lr on the training split (cached in ``--work``), chosen in a child
    process: a process started by one that had grown keeps that size as its own peak RSS
    (Linux carries ``ru_maxrss`` across fork and exec), so this one stays small."""
    path = Path(args.work) / f"lr-{recipe}-{scheme.replace(':', '_')}.json"
    if not path.exists():
        spawn = multiprocessing.get_context("spawn")
        child = spawn.Process(target=_choose_lr, args=(recipe, scheme, args, seed, path))
        child.start()
        child.join()
        if child.exitcode != 0 or not path.exists():
            raise SystemExit(f"the lr choice of {recipe} {scheme} failed ({child.exitcode})")
    cached: dict[str, Any] = json.loads(path.read_text())
    return cached


def _choose_lr(recipe: str, scheme: str, args: argparse.Namespace, seed: int, path: Path) -> None:
    import torch

    from pockengine.finetune.cli import add_arguments, config_from_args
    from pockengine.scheme_choice.lr_choice import choose_lr as choose

    torch.set_num_threads(args.threads)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([*_target(recipe, args), *_options(args, scheme),
                            "--seed", str(seed)])  # fmt: skip
    result = choose(config_from_args(ns), scheme, args.lr_grid, steps=args.lr_steps,
                    holdout=args.lr_holdout, criterion=args.lr_criterion).to_dict()  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def run_one(
    recipe: str, scheme: str, lr: float, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One fine-tune in its own process; its summary.json (cached in ``--work``)."""
    out = Path(args.work) / f"{recipe}-{scheme.replace(':', '_')}-seed{seed}"
    summary = out / "summary.json"
    if _finished(summary) is None:  # none yet, or a run stopped early: resume it
        command = [sys.executable, "-m", "pockengine", "finetune", *_target(recipe, args),
                   *_options(args, scheme), "--scheme", scheme, "--lr", f"{lr:g}",
                   "--seed", str(seed), "--out", str(out), "--progress", "none",
                   "--threads", str(args.threads)]  # fmt: skip
        if out.exists() and (out / "checkpoint.safetensors").exists():
            command.append("--resume")
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True, env=child_env(args.threads))
    data = _finished(summary)
    if data is None:
        raise SystemExit(f"{out}: the run stopped before its test metrics (run it again)")
    return data


def row(
    recipe: str, scheme: str, lr: dict[str, Any], runs: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    metric = "test_accuracy" if "test_accuracy" in runs[0]["test"] else "test_perplexity"
    values = [float(r["test"][metric]) for r in runs]
    auto = [r["auto_scheme"] for r in runs if r.get("auto_scheme")]
    return {
        "recipe": recipe,
        "scheme": scheme,
        "lr": lr["lr"],
        "lr_trials": lr["trials"],
        "metric": metric,
        "values": values,
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "trained_params": runs[0]["trained_params"],
        "planned_peak_mib": statistics.fmean(r["planned_peak_bytes"] for r in runs) / _MIB,
        "peak_rss_mib": max(r["peak_rss_bytes"] for r in runs) / _MIB,
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "analysis_s": statistics.fmean(a["seconds"] for a in auto) if auto else None,
        "auto_choice": [_chosen(a) for a in auto],
    }


def _chosen(auto: dict[str, Any]) -> dict[str, Any]:
    """What one run's ``--scheme auto`` trained beyond its base, and the budget it met."""
    chosen = {c["param"]: c["ratio"] for c in auto["candidates"] if c["ratio"]}
    return {
        "base": auto["base"],
        "weights": chosen,
        "budget_mib": auto["budget_bytes"] / _MIB,
        "planned_peak_mib": auto["planned_peak_bytes"] / _MIB,
        "notes": auto["notes"],
    }


def markdown(rows: Sequence[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", ""]
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = [r for r in rows if r["recipe"] == recipe]
        full = next((r for r in mine if r["scheme"] == "full"), None)
        name = mine[0]["metric"].removeprefix("test_")
        lines += [f"**{recipe}** (test {name}, mean ± std over the seeds)", "",
                  f"| scheme | lr (train split) | seeds | test {name} | vs full | trained params | "
                  "planned peak (MiB) | peak RSS (MiB) | wall (s) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in mine:
            scale = 100.0 if name == "accuracy" else 1.0
            vs = f"{(r['mean'] - full['mean']) * scale:+.1f}" if full and r is not full else ""
            lines.append(
                f"| {r['scheme']} | {r['lr']:g} | {len(r['values'])} "
                f"| {r['mean'] * scale:.1f} ± {r['std'] * scale:.1f} "
                f"| {vs} | {r['trained_params']:,} | {r['planned_peak_mib']:.1f} | "
                f"{r['peak_rss_mib']:.0f} | {r['wall_s']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_doc(tag: str, text: str) -> None:
    markers = f"<!-- quality:{tag}:start -->", f"<!-- quality:{tag}:end -->"
    write_section(DOC, markers, text, title="Quality")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), help="recipes, or generic")
    p.add_argument("--model", help="for generic: a Hugging Face folder")
    p.add_argument("--data", help="for generic: a CSV/JSONL/class folder")
    p.add_argument("--schemes", nargs="+", default=default_schemes())
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add_data_options(p, max_train=None, max_val=None, shapes=_SHAPES)
    p.add_argument("--test-fraction", type=float, default=0.5)
    p.add_argument("--backend", default="torch")
    p.add_argument(
        "--auto-budget",
        metavar="SIZE",
        help="auto's --memory-budget, e.g. 46MB (default: the recipe's)",
    )
    p.add_argument(
        "--auto-score",
        choices=("fisher", "taylor", "grad"),
        help="auto's --auto-score (default: finetune's, fisher)",
    )
    p.add_argument("--batchnorm", choices=("batch", "running"),
                   help="every run's --batchnorm (running: every BatchNorm on its running "
                   "statistics; default: the recipe's)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr-grid", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2])
    p.add_argument("--lr-steps", type=int, default=30)
    p.add_argument("--lr-holdout", type=int, default=200)
    p.add_argument("--lr-criterion", choices=("loss", "accuracy"), default="loss")
    p.add_argument("--work", default="runs/quality", help="run folders and cached lr choices")
    p.add_argument("--tag", default="full")
    p.add_argument("--collect", action="store_true",
                   help="run nothing: the table of the lr choices and finished runs in --work "
                        "(a run done in parts, or cut short)")  # fmt: skip
    args = p.parse_args(argv)
    if "generic" in args.recipes and not (args.model and args.data):
        p.error("the generic run needs --model and --data")
    command = "python benchmarks/quality_table.py " + " ".join(argv or sys.argv[1:])
    rows = []
    for recipe in args.recipes:
        for scheme in args.schemes:
            got = collected(recipe, scheme, args) if args.collect else ran(recipe, scheme, args)
            if got is None:
                continue
            rows.append(row(recipe, scheme, *got))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "lr_trials"}), flush=True)
            save(args.tag, command, rows)  # after each row: a cut-short run keeps them


def ran(
    recipe: str, scheme: str, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The scheme's lr choice and its runs, each made unless ``--work`` holds it."""
    lr = choose_lr(recipe, scheme, args, args.seeds[0])
    return lr, [run_one(recipe, scheme, lr["lr"], seed, args) for seed in args.seeds]


def collected(
    recipe: str, scheme: str, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The scheme's lr choice and finished runs that ``--work`` holds (None: no run); a
    run stopped early (a signal, ``--max-steps``) has no test metrics and is left out."""
    work, name = Path(args.work), f"{recipe}-{scheme.replace(':', '_')}"
    summaries = [_finished(work / f"{name}-seed{seed}" / "summary.json") for seed in args.seeds]
    runs = [r for r in summaries if r is not None]
    if not runs or not (work / f"lr-{name}.json").exists():
        return None
    return json.loads((work / f"lr-{name}.json").read_text()), runs


def _finished(summary: Path) -> dict[str, Any] | None:
    """A run's summary if it finished (it has test metrics and was not stopped early)."""
    if not summary.exists():
        return None
    data: dict[str, Any] = json.loads(summary.read_text())
    return data if data.get("test") and not data.get("stopped") else None


def save(tag: str, command: str, rows: Sequence[dict[str, Any]]) -> None:
    """The rows so far: the results JSON and this tag's table in docs/quality.md."""
    result = {"command": command, "date": utc_now(), "rows": list(rows)}
    write_results(f"quality_table-{tag}", result, indent=1)
    write_doc(tag, markdown(rows, command))


if __name__ == "__main__":
    main()
