"""Resident memory by phase of a fine-tuning run's end-of-epoch work, smollm2-pydocs sparse.

    python benchmarks/eval_phases.py gguf|int4|int8|none     # docs/quant.md

One process, as the trainer does it: load the recipe's model and data (8 train / 16
validation chunks), compile the sparse step with the given ``--frozen-dtype``, compile the
evaluator and release the torch model's float copies of quantized weights, one training
step, one evaluation (compiled), the checkpoint's state (``flat_state_dict`` and the
optimizer state), the best weights and ``RUN/model`` (streamed from the step). Prints the
process's RSS and peak RSS (VmHWM) after each phase.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from quant_phases import mem

from pockengine.finetune.run_folder import home, released
from pockengine.finetune.running.trainer import compile_task
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.metrics import compile_evaluator, evaluate


def main(frozen_dtype: str) -> None:
    torch.set_num_threads(2)
    mem("start (imports)")
    config = FinetuneConfig(recipe="smollm2-pydocs", scheme="sparse", frozen_dtype=frozen_dtype,
                            max_train=8, max_val=16, epochs=1, keep="last")  # fmt: skip
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    mem("model + data loaded")
    step = compile_task(config, task, recipes.parse_scheme("sparse", config.recipe))
    mem("compiled")
    evaluator = compile_evaluator(step, task)
    freed = released.release_held(task.model, step) if evaluator is not None else 0
    mem(f"evaluator compiled, {freed / 2**20:.0f} MiB of float weights released")
    step(*(a[: config.batch_size] for a in task.train))
    mem("one training step")
    print(evaluate(step, task, evaluator=evaluator), flush=True)
    mem("evaluation (16 chunks, compiled)")
    state = step.flat_state_dict(), step.optimizer_state()
    del state
    mem("checkpoint state (flat_state_dict + optimizer state)")
    with tempfile.TemporaryDirectory() as out:
        best = home.BestWeights(Path(out) / home.BEST, task.kind)
        best.offer({"step": 1, "val_loss": 1.0}, released.step_values(step),
                   home.changed_names(task.model, step.trained))  # fmt: skip
        mem("best weights (trained values, from the step)")
        home.write_model(Path(out), task, released.step_values(step), config, best, [], 1)
        mem("RUN/model written")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gguf")
