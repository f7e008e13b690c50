"""Federated evidence (issue 18): sparse FedAvg against full-model FedAvg and central training.

    nice -n 15 python benchmarks/federated_table.py            # minilm-bbc, the whole split
    nice -n 15 python benchmarks/federated_table.py --seq-len 64 --max-train 1000 --max-val 426
    python benchmarks/federated_table.py --seq-len 64 --max-train 1000 --max-val 426 --reuse

Each run is its own process (``python -m pockengine ...``) writing into ``--runs/NAME``:

- ``fed-sparse``: ``pockengine federated --scheme sparse`` (the recipe's sparse scheme);
- ``fed-full``: ``pockengine federated --scheme full`` (full-model FedAvg), and with
  ``--full-lr X`` also ``fed-full-lrX``, full-model FedAvg at that peak learning rate;
- ``central-sparse``: ``pockengine finetune --scheme sparse --epochs ROUNDS*LOCAL_EPOCHS``,
  the same recipe trained on the pooled training split for the same number of passes.
- ``fed-STEM`` for each ``--scheme-file STEM.json``: sparse FedAvg with that scheme
  (a partial-channel scheme, for the byte target).

``--server-optimizer``, ``--server-lr``, ``--server-momentum``, ``--server-betas``,
``--server-tau``, ``--bn-statistics``, ``--local-loss`` and ``--la-tau`` go to every
federated run alike (the server's optimizer, which BatchNorm statistics travel, and the
clients' loss). ``--client-lr`` sets the local
learning rate of the sparse federated runs (``fed-sparse`` and the scheme files').

All runs share the recipe, data subset, shapes and seed, so they hold out the same
validation split: the federated server evaluates centrally on the recipe's validation
split, which ``finetune`` evaluates on after each epoch. ``--reuse`` reads a run whose
``summary.json`` is already there instead of running it again (the commands are the same).

Reads each ``rounds.jsonl`` (and the central run's evaluation history) and writes
``benchmarks/results/federated-<recipe>.json`` and the markdown table between the
recipe's markers in docs/federated.md: final and best accuracy, bytes sent up a round,
their ratio to full-model FedAvg's, and the central run's accuracy. Wall times are
recorded but depend on the machine's load; accuracy does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_SHARED = ("recipe", "seq_len", "image_size", "max_train", "max_val", "seed", "backend")
# federation options every federated run gets (sparse and full alike), when given
_SERVER = ("server_optimizer", "server_lr", "server_momentum", "server_betas", "server_tau",
           "bn_statistics", "local_loss", "la_tau")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One process of the benchmark: a federated run or the central one."""

    name: str
    federated: bool
    scheme: str
    lr: float | None = None


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs, in the order they start (the central run beside the first federated one)."""
    client_lr = getattr(args, "client_lr", None)  # the sparse federated runs' lr
    runs = [Run("fed-sparse", True, "sparse", client_lr), Run("central-sparse", False, "sparse")]
    runs.append(Run("fed-full", True, "full"))
    if args.full_lr is not None:
        runs.append(Run(f"fed-full-lr{args.full_lr:g}", True, "full", args.full_lr))
    for path in getattr(args, "scheme_file", None) or []:  # e.g. partial-channel schemes
        runs.append(Run(f"fed-{Path(path).stem}", True, str(Path(path).resolve()), client_lr))
    return runs


def command(run: Run, args: argparse.Namespace) -> list[str]:
    """The command line of ``run`` (without the interpreter)."""
    cmd = ["federated" if run.federated else "finetune", "--scheme", run.scheme]
    for key in _SHARED:
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if run.lr is not None:
        cmd += ["--lr", f"{run.lr:g}"]
    if run.federated:
        cmd += ["--clients", str(args.clients), "--rounds", str(args.rounds),
                "--local-epochs", str(args.local_epochs), "--partition", "dirichlet",
                "--alpha", f"{args.alpha:g}", "--threads", "1"]  # fmt: skip
        cmd += _server_options(args)
    else:
        cmd += ["--epochs", str(args.rounds * args.local_epochs), "--threads", "1",
                "--progress", "plain"]  # fmt: skip
    return [*cmd, "--out", str(args.runs / run.name)]


def _server_options(args: argparse.Namespace) -> list[str]:
    """The server options given (every federated run gets the same), as arguments."""
    out = []
    for key in _SERVER:
        value = getattr(args, key, None)
        if value is not None:
            values = value if isinstance(value, list | tuple) else [value]
            out += [f"--{key.replace('_', '-')}", *(f"{v:g}" if isinstance(v, float) else str(v)
                                                    for v in values)]  # fmt: skip
    return out


def start(run: Run, args: argparse.Namespace) -> subprocess.Popen[bytes] | None:
    """Start ``run`` in its own process (None if ``--reuse`` finds it finished); its
    output goes to ``--runs/NAME.log``."""
    out = args.runs / run.name
    if args.reuse and (out / "summary.json").exists():
        print(f"{run.name}: reusing {out}", file=sys.stderr)
        return None
    cmd = [sys.executable, "-m", "pockengine", *command(run, args)]
    print(f"{run.name}: {' '.join(cmd[1:])}", file=sys.stderr)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    with (args.runs / f"{run.name}.log").open("wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def execute(runs: list[Run], args: argparse.Namespace) -> None:
    """Every run, at most ``--jobs`` at a time, in plan order; exits if one fails."""
    pending, running = list(runs), dict[str, subprocess.Popen[bytes]]()
    while pending or running:
        while pending and len(running) < args.jobs:
            run = pending.pop(0)
            if (process := start(run, args)) is not None:
                running[run.name] = process
        for name, process in list(running.items()):
            if process.poll() is not None:
                del running[name]
                if process.returncode != 0:
                    raise SystemExit(f"{name} failed ({process.returncode}): see its .log")
        time.sleep(2)


def federated_row(run: Run, out: Path) -> dict[str, Any]:
    """Accuracy and bytes of a federated run, from its ``rounds.jsonl`` and summary."""
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line]
    summary = json.loads((out / "summary.json").read_text())
    accuracy = [r["accuracy"] for r in rows]
    return {
        "run": run.name,
        "scheme": run.scheme,
        "lr": summary["config"]["finetune"]["lr"],
        "rounds": len(rows),
        "initial_accuracy": summary["initial"].get("accuracy"),
        "accuracy_by_round": accuracy,
        "final_accuracy": accuracy[-1],
        "best_accuracy": max(accuracy),
        "final_loss": rows[-1]["loss"],
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_up_per_round": sum(r["bytes_up"] for r in rows) / len(rows),
        "bytes_full_model": sum(r["bytes_full_model"] for r in rows),
        "dropped": sum(len(r["dropped"]) for r in rows),
        "trained_tensors": len(summary["trained_tensors"]),
        "wall_s": summary["wall_s"],
    }


def central_row(run: Run, out: Path) -> dict[str, Any]:
    """Accuracy of the central run after each epoch, from its summary's history."""
    summary = json.loads((out / "summary.json").read_text())
    accuracy = [h["val_accuracy"] for h in summary["history"] if "val_accuracy" in h]
    return {
        "run": run.name,
        "scheme": run.scheme,
        "lr": summary["config"]["lr"],
        "epochs": summary["epochs_done"],
        "accuracy_by_epoch": accuracy,
        "final_accuracy": accuracy[-1],
        "best_accuracy": max(accuracy),
        "final_loss": summary["final"]["val_loss"],
        "train_examples": summary["train_examples"],
        "val_examples": summary["val_examples"],
        "wall_s": summary["wall_s"],
    }


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's three targets, as measured (accuracy in points, bytes as a ratio)."""
    sparse, full = rows["fed-sparse"], rows["fed-full"]
    fulls = [r for name, r in rows.items() if name.startswith("fed-full")]
    best_full = max(fulls, key=lambda r: r["final_accuracy"])

    def below(other: dict[str, Any]) -> float:
        return 100 * float(other["final_accuracy"] - sparse["final_accuracy"])

    return {
        "up_ratio_vs_full_fedavg": sparse["bytes_up"] / full["bytes_up"],
        "up_ratio_vs_full_model_bytes": sparse["bytes_up"] / sparse["bytes_full_model"],
        "points_below_central": below(rows["central-sparse"]),
        "points_below_full_fedavg": below(full),
        "best_full_fedavg": best_full["run"],
        "points_below_best_full_fedavg": below(best_full),
    }


def _markers(recipe: str) -> tuple[str, str]:
    return f"<!-- federated-table:{recipe}:start -->", f"<!-- federated-table:{recipe}:end -->"


def _table_row(r: dict[str, Any], full_up: float) -> str:
    if "bytes_up" not in r:  # the central run
        return (
            f"| {r['run']} ({r['epochs']} epochs) | {r['lr']:g} | {r['final_accuracy']:.4f} "
            f"| {r['best_accuracy']:.4f} | {r['final_loss']:.3f} | - | - |"
        )
    return (
        f"| {r['run']} ({r['rounds']} rounds) | {r['lr']:g} | {r['final_accuracy']:.4f} "
        f"| {r['best_accuracy']:.4f} | {r['final_loss']:.3f} "
        f"| {r['bytes_up_per_round'] / 1e6:.1f} | {r['bytes_up'] / full_up:.4f} |"
    )


def _gap(points_below: float) -> str:
    """``3.00 points below`` or ``2.00 points above`` (the sparse run against another)."""
    return f"{abs(points_below):.2f} points {'below' if points_below >= 0 else 'above'}"


def table(result: dict[str, Any]) -> str:
    rows, cmp, args = result["rows"], result["compare"], result["args"]
    start, end = _markers(args["recipe"])
    full_up = rows["fed-full"]["bytes_up"]
    lines = [
        start,
        f"Generated by `{result['command']}` ({result['machine']}).",
        "",
        "| run | lr | final accuracy | best accuracy | final loss | MB sent up a round "
        "| vs full-model FedAvg |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(_table_row(r, full_up) for r in rows.values()),
        "",
        f"Sparse FedAvg ends {_gap(cmp['points_below_central'])} central training and "
        f"{_gap(cmp['points_below_full_fedavg'])} full-model FedAvg at the recipe's lr "
        f"({_gap(cmp['points_below_best_full_fedavg'])} the best full-model run, "
        f"{cmp['best_full_fedavg']}). It sent {cmp['up_ratio_vs_full_fedavg']:.4f} of "
        "full-model FedAvg's bytes "
        f"({rows['fed-sparse']['bytes_up']:,} / {full_up:,} B over the run).",
        end,
    ]
    return "\n".join(lines)


def write_doc(path: Path, text: str, recipe: str) -> None:
    start, end = _markers(recipe)
    doc = path.read_text()
    if start not in doc or end not in doc:
        doc = doc.rstrip() + f"\n\n### {recipe}\n\n{start}\n{end}\n"
    head, rest = doc.split(start, 1)
    path.write_text(head + text + rest.split(end, 1)[1])


def _command_line(args: argparse.Namespace) -> str:
    keys = (*_SHARED, "clients", "rounds", "local_epochs", "alpha", "client_lr", "full_lr")
    opts = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in keys if getattr(args, k)]
    opts += _server_options(args)
    if args.scheme_file:
        opts.append("--scheme-file " + " ".join(Path(f).name for f in args.scheme_file))
    return "nice -n 15 python benchmarks/federated_table.py " + " ".join(opts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--recipe", default="minilm-bbc")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--full-lr", type=float, help="also run full-model FedAvg at this lr")
    p.add_argument("--client-lr", type=float, help="the sparse federated runs' --lr (fed-sparse "
                   "and the scheme files'; default: the recipe's, as central-sparse)")  # fmt: skip
    p.add_argument("--scheme-file", nargs="*", default=[], metavar="JSON",
                   help="also run FedAvg with these scheme files (rows fed-STEM)")  # fmt: skip
    p.add_argument("--server-optimizer", choices=("avg", "avgm", "adam", "yogi", "adagrad"),
                   help="the federated runs' --server-optimizer")  # fmt: skip
    p.add_argument("--server-lr", type=float, help="their --server-lr")
    p.add_argument("--server-momentum", type=float, help="their --server-momentum (FedAvgM)")
    p.add_argument("--server-betas", type=float, nargs=2, help="their --server-betas")
    p.add_argument("--server-tau", type=float, help="their --server-tau")
    p.add_argument("--bn-statistics", choices=("recompute", "running"),
                   help="their --bn-statistics (default: pockengine federated's)")  # fmt: skip
    p.add_argument("--local-loss", choices=("plain", "logit-adjusted"),
                   help="their --local-loss (default: pockengine federated's)")  # fmt: skip
    p.add_argument("--la-tau", type=float, help="their --la-tau")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--image-size", type=int)
    p.add_argument("--max-train", type=int)
    p.add_argument("--max-val", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="torch")
    p.add_argument("--runs", type=Path, help="where the runs go (default runs/fed-table-RECIPE)")
    p.add_argument("--reuse", action="store_true", help="read finished runs, do not rerun them")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each federated run is "
                   "clients + 1 processes: mind the memory)")  # fmt: skip
    p.add_argument("--machine", default=f"{os.cpu_count()} cores, shared; runs under nice")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "federated.md")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.runs = (args.runs or ROOT / "runs" / f"fed-table-{args.recipe}").resolve()
    runs = plan(args)
    execute(runs, args)
    rows = {
        r.name: (federated_row if r.federated else central_row)(r, args.runs / r.name) for r in runs
    }
    result = {
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("doc", "results")},
        "command": _command_line(args),
        "machine": args.machine,
        "commands": {r.name: "pockengine " + " ".join(command(r, args)) for r in runs},
        "rows": rows,
        "compare": compare(rows),
    }
    path = args.results / f"federated-{args.recipe}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    write_doc(args.doc, table(result), args.recipe)
    print(table(result))


if __name__ == "__main__":
    main()
