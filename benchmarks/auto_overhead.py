"""What ``--scheme auto`` adds to the default fine-tune (minilm-bbc, 16 x 128 tokens).

In one process, with a fresh score cache: the time of ``choose_auto`` (import, planning,
the gradient estimate, the search and its repair), then the compile and the median time
of a ``sparse`` step of the default run, and the ratio of the analysis to the default
run's steps alone (its compile and evaluations would only lower it).

    OMP_NUM_THREADS=1 python benchmarks/auto_overhead.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import torch

from pockengine.finetune import FinetuneConfig, recipes
from pockengine.finetune.auto_scheme import choose_auto
from pockengine.finetune.trainer import compile_task


def main() -> None:
    os.environ["PE_CACHE"] = tempfile.mkdtemp()  # time the analysis, never a cached one
    torch.set_num_threads(1)
    config = FinetuneConfig(scheme="sparse", backend="torch")
    config = config.with_defaults(recipes.defaults(config)).validate()
    assert config.batch_size is not None and config.epochs is not None
    task = recipes.build(config)
    start = time.perf_counter()
    choice = choose_auto(config, task, recipes.RECIPES["minilm-bbc"].sparse)
    auto_s = time.perf_counter() - start
    start = time.perf_counter()
    step = compile_task(config, task, recipes.parse_scheme("sparse", config.recipe))
    compile_s = time.perf_counter() - start
    times = []
    for i in range(6):
        rows = slice(i * config.batch_size, (i + 1) * config.batch_size)
        batch = tuple(np.ascontiguousarray(a[rows]) for a in task.train)
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times[1:]))
    steps = config.epochs * (task.train_size // config.batch_size)
    print(json.dumps({
        "auto_s": auto_s, "estimate_s": choice.estimate_seconds, "compile_s": compile_s,
        "sparse_step_s": step_s, "default_steps": steps,
        "ratio_to_steps_only": auto_s / (steps * step_s),
        "planned_peak_mib": choice.planned_peak_bytes / 2**20,
        "budget_mib": choice.budget_bytes / 2**20, "notes": choice.notes,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
