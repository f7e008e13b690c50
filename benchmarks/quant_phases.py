"""Resident memory by phase of the smollm2-pydocs sparse recipe, one process, one step.

    python benchmarks/quant_phases.py gguf|int4|int8|none     # docs/quant.md

Loads the recipe's model and data (8 train / 8 validation chunks), compiles the sparse
step with the given ``--frozen-dtype``, runs one training step and one evaluation, and
prints the process's RSS and peak RSS (VmHWM) after each phase.
"""

from __future__ import annotations

import sys
import time

import torch
from _harness import vm_kib

from pockengine.finetune.running.trainer import compile_task
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.metrics import evaluate


def mem(label: str) -> None:
    rss, peak = vm_kib("VmRSS") // 1024, vm_kib("VmHWM") // 1024
    print(f"{time.strftime('%H:%M:%S')} {label}: RSS {rss} MiB, peak {peak} MiB", flush=True)


def main(frozen_dtype: str) -> None:
    torch.set_num_threads(2)
    mem("start (imports)")
    config = FinetuneConfig(recipe="smollm2-pydocs", scheme="sparse", frozen_dtype=frozen_dtype,
                            max_train=8, max_val=8, epochs=1)  # fmt: skip
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    mem("model + data loaded")
    step = compile_task(config, task, recipes.parse_scheme("sparse", config.recipe))
    mem("compiled")
    print("frozen bytes by dtype:", step.report().ours.frozen_bytes, flush=True)
    step(*(a[: config.batch_size] for a in task.train))
    mem("one training step")
    print(evaluate(step, task, batch_size=8), flush=True)
    mem("evaluation (8 chunks)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gguf")
