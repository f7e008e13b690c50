"""Compiling a run's training step and its evaluator, for the process that trains
(``--compile-in process``), the compile child (``compile_child``) and the tools that
rebuild a run's step (``pockengine export``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pockengine.finetune.run_folder import released
from pockengine.passes.quantize import FrozenWeights
from pockengine.sparse.schemes import Scheme
from pockengine.step.compiler import TrainStep, release_free_memory
from pockengine.step.evaluator import Evaluator
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.lm_buckets import compile_bucketed
from pockengine.tasks.metrics import compile_evaluator

__all__ = ["compile_evaluator_releasing", "compile_task", "remat_budget"]

log = logging.getLogger(__name__)


def compile_task(
    config: FinetuneConfig, task: recipes.Task, scheme: Scheme, frozen: FrozenWeights | None = None
) -> TrainStep:
    """The training step a run of ``config`` (defaults filled in) compiles for ``task``:
    the same batch shape, optimizer and scheme, for tools that rebuild a run's step
    (``pockengine export``). ``frozen``: ``gguf.frozen_weights(config)`` when the caller
    has read it already."""
    from pockengine.step.compiler import compile
    from pockengine.tasks.gguf import frozen_weights

    assert config.batch_size is not None
    example = recipes.tensor_rows(task.train, 0, config.batch_size)
    task.model.train()  # dropout on: its seed is the step's "rng.seed" state
    frozen = frozen_weights(config) if frozen is None else frozen

    def one(batch: Sequence[Any]) -> TrainStep:
        return compile(
            task.model,
            task.loss_fn,
            batch,
            optimizer=config.make_optimizer(),
            scheme=scheme,
            backend=config.backend,
            frozen_dtype=frozen.dtype,
            quantized=frozen.given,
            memory_budget=remat_budget(config),
            compile_in="process",  # the fine-tune's own child, or --compile-in process: here
        )

    if task.buckets:  # a step a length bucket, one store (lm_buckets)
        return compile_bucketed(one, task.train, task.buckets, config.batch_size)
    return one(example)


def remat_budget(config: FinetuneConfig) -> int | None:
    """The step's recomputation budget in bytes (``--remat-budget``; 0, "none": none)."""
    return int(config.remat_budget) if config.remat_budget else None


def compile_evaluator_releasing(step: TrainStep, task: recipes.Task) -> Evaluator | None:
    """Validation compiled on the step (once per run); where it is, the model's float
    copies of the weights the step stores quantized, and of the params it trains (the step
    holds its own), are released: nothing reads them (``RUN/model`` is streamed from the
    step)."""
    evaluator = compile_evaluator(step, task)
    if evaluator is not None:
        own = dict(task.model.named_parameters())  # LoRA factors are the step's only
        trained = [n for n in step.trained if n in own]
        freed = released.release_held(task.model, step, also=trained)
        if freed:
            log.info(
                "released %.1f MiB of model weights the step holds (quantized or trained)",
                freed / 2**20,
            )
            release_free_memory()
    return evaluator
