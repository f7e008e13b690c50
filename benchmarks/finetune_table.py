"""Fine-tuning evidence: a recipe under full, bias, sparse and head, each in its own process.

    python benchmarks/finetune_table.py                          # minilm-bbc, docs/finetune.md
    python benchmarks/finetune_table.py --recipe lite0-fashion --max-train 1000
    python benchmarks/finetune_table.py --max-train 1701 --epochs 2 --seq-len 128
    python benchmarks/finetune_table.py --recipe smollm2-pydocs --schemes sparse \
        --frozen-dtype gguf                                      # low-bit frozen weights

Per scheme: final validation accuracy (perplexity for a causal LM), mean step time,
compile time, peak RSS of the process (VmHWM: model, data, the compiled step and
evaluation together) and the wall time of the whole run. Writes
benchmarks/results/finetune_table-<recipe>.json and the table between the recipe's
markers in docs/finetune.md, with the subset and epochs it used. Shape options left out
take the recipe's defaults. ``--frozen-dtype`` (int8, int4, gguf; docs/quant.md) stores
the frozen weights low-bit; its results go to ``finetune_table-<recipe>-<dtype>.json`` and
their own markers, beside the float32 table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("full", "bias", "sparse", "head")


def _markers(recipe: str, frozen_dtype: str = "none") -> tuple[str, str]:
    if frozen_dtype != "none":
        recipe = f"{recipe}:{frozen_dtype}"
    return f"<!-- finetune-table:{recipe}:start -->", f"<!-- finetune-table:{recipe}:end -->"


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(args: argparse.Namespace) -> None:
    import torch

    import pockengine as pe

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        shapes = {k: getattr(args, k) for k in _SHAPES if getattr(args, k) is not None}
        result = pe.finetune(
            recipe=args.recipe,
            scheme=args.child,
            max_train=args.max_train,
            max_val=args.max_val,
            backend=args.backend,
            frozen_dtype=args.frozen_dtype,
            out=out,
            progress="none",
            seed=args.seed,
            **shapes,
        )
    metric = "val_accuracy" if "val_accuracy" in result.final else "val_perplexity"
    row = {
        "scheme": args.child,
        "frozen_dtype": args.frozen_dtype,
        "metric": metric,
        "value": result.final[metric],
        "val_loss": result.final["val_loss"],
        "epochs": result.config.epochs,
        "batch_size": result.config.batch_size,
        "shape": result.config.seq_len or result.config.image_size,
        "lr": result.config.lr,
        "step_s": result.step_s,
        "compile_s": result.compile_s,
        "steps": result.steps,
        "peak_rss_mib": _peak_rss_mib(),
        "wall_s": time.perf_counter() - start,
        "train_examples": result.train_examples,
        "val_examples": result.val_examples,
    }
    print(json.dumps(row))


_SHAPES = ("seq_len", "image_size", "epochs", "batch_size")
_FROZEN = {"none": "float32", "int8": "int8 per channel", "int4": "int4 (groups of 32)",
           "gguf": "the shipped GGUF blocks"}  # fmt: skip


def _run_case(scheme: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", scheme]
    keys = ("recipe", "max_train", "max_val", *_SHAPES, "backend", "frozen_dtype", "threads",
            "seed")  # fmt: skip
    for key in keys:
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{scheme} failed:\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _command(args: argparse.Namespace) -> str:
    opts = [f"--recipe {args.recipe}"]
    for key in ("max_train", "max_val", *_SHAPES):
        if getattr(args, key) is not None:
            opts.append(f"--{key.replace('_', '-')} {getattr(args, key)}")
    opts += [f"--backend {args.backend}", f"--threads {args.threads}"]
    if args.frozen_dtype != "none":
        opts.append(f"--frozen-dtype {args.frozen_dtype}")
    return "python benchmarks/finetune_table.py " + " ".join(opts)


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    first = rows[0]
    start, end = _markers(args.recipe, args.frozen_dtype)
    metric = "val accuracy" if first["metric"] == "val_accuracy" else "val perplexity"
    shape = first["shape"]
    lines = [
        start,
        f"{args.recipe} with the `{args.backend}` backend, {args.threads} thread(s), "
        f"frozen weights {_FROZEN[args.frozen_dtype]}: "
        f"{first['train_examples']} training / {first['val_examples']} validation examples "
        f"(the first of the seeded split, seed {args.seed}), {first['epochs']} epoch(s), "
        f"batch {first['batch_size']} (x {shape}), AdamW at each scheme's default peak "
        "learning rate (linear warmup 10%, then linear decay). Generated by "
        f"`{_command(args)}`.",
        "",
        f"| scheme | lr | {metric} | val loss | step (s) | compile (s) | peak RSS (MiB) "
        "| wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        value = f"{r['value']:.3f}" if r["metric"] == "val_accuracy" else f"{r['value']:.2f}"
        lines.append(
            f"| {r['scheme']} | {r['lr']:g} | {value} | {r['val_loss']:.3f} "
            f"| {r['step_s']:.2f} | {r['compile_s']:.1f} | {r['peak_rss_mib']:.0f} "
            f"| {r['wall_s']:.0f} |"
        )
    return "\n".join([*lines, end])


def _write_doc(path: Path, table: str, recipe: str, frozen_dtype: str = "none") -> None:
    start, end = _markers(recipe, frozen_dtype)
    text = path.read_text() if path.exists() else "# Fine-tuning\n"
    if start not in text or end not in text:
        title = recipe if frozen_dtype == "none" else f"{recipe}, frozen weights {frozen_dtype}"
        text = text.rstrip() + f"\n\n### {title}\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(head + table + tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--recipe", default="minilm-bbc")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    p.add_argument("--max-train", type=int, default=256)
    p.add_argument("--max-val", type=int, default=200)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--image-size", type=int)
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--backend", default="torch")
    p.add_argument("--frozen-dtype", choices=tuple(_FROZEN), default="none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "finetune.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    rows = []
    for scheme in args.schemes:
        rows.append(_run_case(scheme, args))
        print(json.dumps(rows[-1]), file=sys.stderr)
    suffix = "" if args.frozen_dtype == "none" else f"-{args.frozen_dtype}"
    results = ROOT / "benchmarks" / "results" / f"finetune_table-{args.recipe}{suffix}.json"
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("doc", "child")}
    results.write_text(json.dumps({"args": settings, "rows": rows}, indent=2) + "\n")
    _write_doc(args.doc, _table(rows, args), args.recipe, args.frozen_dtype)


if __name__ == "__main__":
    main()
