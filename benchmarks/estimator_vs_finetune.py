"""How well the gradient estimate predicts the fine-tune-based contribution analysis.

For every weight of a recipe's model (ratio 1, over the ``bias`` baseline), the
fine-tune-based analysis (``pockengine.scheme_choice.sensitivity``: one short fine-tune per
candidate, scored on held-out training examples) gives a contribution; the gradient
estimate (``pockengine.scheme_choice.estimate``) gives fisher, taylor and grad scores from
1, 2, 4 and 6 backward passes on the same held-out training examples. This script
writes the Spearman rank correlation of each score with the contributions, and each
side's time, to ``benchmarks/results/estimator_vs_finetune-<recipe>.json``.

    python benchmarks/estimator_vs_finetune.py --recipe minilm-bbc --seq-len 64 \\
        --max-train 384 --holdout 96 --steps 12 --cache runs/h6/ftcache

The fine-tune records are cached one JSON a candidate in ``--cache`` (an interrupted run
resumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import utc_now, write_results
from scipy.stats import spearmanr

from pockengine.finetune.run_folder.checkpoint import write_atomic
from pockengine.frontend.torch import import_torch
from pockengine.scheme_choice import sensitivity as sv
from pockengine.scheme_choice.auto_scheme import _extra
from pockengine.scheme_choice.estimate import (
    SCORES,
    EstimateSettings,
    Planner,
    candidate_weights,
    estimate_scores,
    optimizer_of,
)
from pockengine.tasks.config import FinetuneConfig


def finetune_contributions(builder: sv.StepBuilder, folder: Path) -> dict[str, float]:
    """Contribution (held-out accuracy over the bias baseline) of every weight at ratio 1."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [sv.Candidate("baseline", "bias", tuple(builder.bias))]
    jobs += sv.candidates(builder.info, ratios=(1.0,), biases=False)
    records = {}
    for c in jobs:
        record = sv._cached(folder, c)
        if record is None:
            record = builder.measure(c)
            write_atomic(
                sv._path(folder, record.key), json.dumps(dataclasses.asdict(record)).encode()
            )
            print(f"{record.key}: {record.val_accuracy:.4f} ({record.seconds:.1f} s)", flush=True)
        records[c.key] = record
    base = records["baseline:bias"].val_accuracy
    seconds = sum(r.seconds for r in records.values())
    out = {r.params[0]: r.val_accuracy - base for k, r in records.items() if k != "baseline:bias"}
    out["__seconds__"] = seconds
    return out


def estimates(builder: sv.StepBuilder, counts: list[int]) -> dict[int, dict[str, Any]]:
    """The gradient scores of every weight from ``n`` backward passes, for each count, on
    the examples the fine-tune analysis scores candidates on."""
    task, config = builder.task, builder.config
    # The estimate reads the last examples of ``task.train``: make those the held-out ones.
    joined = dataclasses.replace(
        task, train=tuple(np.concatenate([a, b]) for a, b in zip(task.train, task.val, strict=True))
    )
    example = tuple(torch.from_numpy(a[: config.batch_size]) for a in joined.train)
    planner = Planner(
        builder.info,
        lambda ev: import_torch(task.model, task.loss_fn, example, eval_modules=ev),
        optimizer_of(config),
    )
    weights = candidate_weights(builder.info, set(builder.bias))
    slots = 2 if config.optimizer == "adamw" else 1
    out = {}
    for n in counts:
        est = estimate_scores(config, joined, planner, weights, EstimateSettings(batches=n))
        out[n] = {
            "seconds": est.seconds,
            "scores": {k: {w.param: w.score(k, 1.0) for w in est.weights} for k in SCORES},
            "extra_bytes": {w.param: _extra(w, 1.0, slots)["memory"] for w in est.weights},
        }
    return out


def led_schemes(
    builder: sv.StepBuilder, contribution: dict[str, float], est: dict[str, Any], folder: Path
) -> dict[str, list[str]]:
    """The weights each table leads the knapsack to (ratio 1, the same estimated costs),
    within the estimated extra bytes of what ``sparse`` trains beyond ``bias``; each
    written as a scheme file into ``folder`` for fine-tunes to compare."""
    from pockengine.scheme_choice.search import Budget, Item, choose, scheme_for
    from pockengine.sparse import schemes

    sparse = schemes.sparse(frozen_bn="eval").resolve(builder.info).names - set(builder.bias)
    room = sum(est["extra_bytes"][k] for k in sparse if k in est["extra_bytes"])
    tables = {"finetune": contribution, **{k: est["scores"][k] for k in SCORES}}
    out = {}
    for name, values in tables.items():
        items = [Item(k, k, float(values[k]), {"memory": est["extra_bytes"][k]}, (k,))
                 for k in contribution]  # fmt: skip
        chosen = choose(items, Budget({"memory": room})).items
        out[name] = sorted(i.key for i in chosen)
        schemes.save(scheme_for(builder.bias, chosen), folder / f"led-{name}.yaml")
    out["sparse"] = sorted(sparse)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="minilm-bbc")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-train", type=int, default=384)
    p.add_argument("--holdout", type=int, default=96)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 6])
    p.add_argument("--cache", default="runs/estimator-eval/finetune")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["PE_CACHE"] = tempfile.mkdtemp()  # time the estimate, never read a cached one
    settings = sv.AnalysisSettings(steps=args.steps, holdout=args.holdout)
    config = FinetuneConfig(
        recipe=args.recipe, seq_len=args.seq_len, max_train=args.max_train, backend="torch"
    )
    config = sv.analysis_config(config, settings)
    builder = sv.StepBuilder(config, settings)
    contribution = finetune_contributions(builder, Path(args.cache))
    ft_seconds = contribution.pop("__seconds__")
    names = sorted(contribution)
    rows = []
    ests = estimates(builder, args.counts)
    for n, est in ests.items():
        for kind in SCORES:
            rho = spearmanr(
                [contribution[k] for k in names], [est["scores"][kind][k] for k in names]
            )
            per_byte = spearmanr(
                [contribution[k] / est["extra_bytes"][k] for k in names],
                [est["scores"][kind][k] / est["extra_bytes"][k] for k in names],
            )
            rows.append(
                {
                    "batches": n,
                    "score": kind,
                    "spearman": float(rho.statistic),
                    "spearman_per_byte": float(per_byte.statistic),
                    "seconds": est["seconds"],
                }
            )
            print(rows[-1], flush=True)
    result_schemes = led_schemes(builder, contribution, ests[max(args.counts)], Path(args.cache))
    result = {
        "command": "python benchmarks/estimator_vs_finetune.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
        ),
        "candidates": len(names),
        "finetune_seconds": ft_seconds,
        "contributions": contribution,
        "rows": rows,
        "schemes": result_schemes,
        "date": utc_now(),
    }
    print(write_results(f"estimator_vs_finetune-{args.recipe}", result, indent=1))


if __name__ == "__main__":
    main()
