"""What ``--scheme auto`` adds to the default fine-tune (minilm-bbc, 16 x 128 tokens), and
whether its cheap gradient passes rank the weights as whole batches do.

In one process, with a fresh score cache: the time of ``choose_auto`` (import, planning,
the gradient estimate in micro-batches and weight groups, the search and its repair) and
the process's peak RSS after it; with ``--compare``, the estimate again with whole batches
in one group (the estimator before micro-batches) and the Spearman rank correlation of
the two Fisher scores over the candidate weights, and how many of the top ``--top``
weights they share. The whole run's wall time and each process's peak are
``benchmarks/tree_memory.py``'s (docs/search.md).

    OMP_NUM_THREADS=1 python benchmarks/auto_overhead.py --compare
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _harness import vm_mib

from pockengine.finetune import FinetuneConfig
from pockengine.scheme_choice import estimate as est
from pockengine.scheme_choice.auto_scheme import choose_auto
from pockengine.tasks import recipes


def _ranks(values: list[float]) -> np.ndarray[Any, Any]:
    return np.argsort(np.argsort(values)).astype(np.float64)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties in these scores)."""
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def _whole_batch_scores(config: FinetuneConfig, task: recipes.Task) -> dict[str, float]:
    """The Fisher scores of the estimator before micro-batches: whole batches, one group."""
    from pockengine.frontend.torch import import_torch, torch_model_info
    from pockengine.sparse.schemes import scheme_named

    assert config.batch_size is not None
    example = tuple(torch.from_numpy(np.ascontiguousarray(a[: config.batch_size]))
                    for a in task.train)  # fmt: skip
    info = torch_model_info(task.model)

    def import_rows(ev: set[str], rows: int | None) -> Any:
        return import_torch(task.model, task.loss_fn, [a[:rows] for a in example], ev)

    planner = est.Planner(info, import_rows, est.optimizer_of(config))
    base = set(scheme_named("bias", frozen_bn="eval").resolve(info).names)
    settings = est.EstimateSettings(micro_batch=config.batch_size, group_bytes=1 << 40)
    os.environ["PE_CACHE"] = tempfile.mkdtemp()
    scores = est.estimate_scores(config, task, planner, est.candidate_weights(info, base),
                                 settings)  # fmt: skip
    return {w.param: w.score("fisher", 1.0) for w in scores.weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="also whole-batch scores")
    parser.add_argument("--top", type=int, default=9, help="top weights compared")
    options = parser.parse_args()
    os.environ["PE_CACHE"] = tempfile.mkdtemp()  # time the analysis, never a cached one
    torch.set_num_threads(1)
    config = FinetuneConfig(backend="torch")
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    task.model.train()
    start = time.perf_counter()
    choice = choose_auto(config, task, recipes.RECIPES["minilm-bbc"].sparse)
    out: dict[str, Any] = {
        "scheme": config.scheme, "auto_s": time.perf_counter() - start,
        "estimate_s": choice.estimate_seconds, "peak_rss_mib": vm_mib("VmHWM"),
        "planned_peak_mib": choice.planned_peak_bytes / 2**20,
        "budget_mib": choice.budget_bytes / 2**20, "notes": choice.notes,
        "chosen": sorted(c["param"] for c in choice.candidates if c["ratio"]),
    }  # fmt: skip
    if options.compare:
        now = {c["param"]: c["score"] for c in choice.candidates}
        before = _whole_batch_scores(config, task)
        names = sorted(now)
        top = [set(sorted(d, key=lambda n: -d[n])[: options.top]) for d in (now, before)]
        out |= {"spearman_vs_whole_batches": spearman([now[n] for n in names],
                                                      [before[n] for n in names]),
                f"top{options.top}_shared": len(top[0] & top[1])}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
