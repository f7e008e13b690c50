"""Fine-tuning as ``pockengine finetune`` runs it: compile once, then a ``loop.Loop``.

``launch.run(config)`` (re-exported here as ``run``) checks the options, takes the run
folder's lock and, with ``--compile-in child``, has a child compile; then
``train_compiled`` loads what the child wrote, or ``train_here`` chooses the scheme
(``--scheme auto`` analyses first), builds the task, compiles one ``TrainStep`` for the
fixed batch shape and the compiled evaluator (after which the model's copies of the
weights the step holds are released). Either resumes from a checkpoint if asked, trains
(``loop.Loop``: epochs, schedule, validation, checkpoints; SIGINT/SIGTERM stop it after
the current step with a checkpoint), then writes ``RUN/model``, the adapter if any, the
test metrics and the summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pockengine.finetune import adapter, home, recipes, released, stages
from pockengine.finetune import checkpoint as ckpt_io
from pockengine.finetune.auto_scheme import AUTO, AutoChoice, choose_auto
from pockengine.finetune.compiled_task import load_compiled
from pockengine.finetune.config import FinetuneConfig
from pockengine.finetune.curves import RunInfo
from pockengine.finetune.launch import run
from pockengine.finetune.loop import Loop, linear_schedule, stop_on_signals
from pockengine.finetune.metrics import compile_evaluator, evaluate
from pockengine.finetune.model_skeleton import write_from_skeleton
from pockengine.finetune.result import FinetuneResult, peak_rss_bytes, write_report
from pockengine.passes.quantize import FrozenWeights
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.step.compiler import TrainStep, release_free_memory
from pockengine.step.evaluator import Evaluator
from pockengine.step.running import CompiledStep

__all__ = [
    "compile_evaluator_releasing",
    "compile_task",
    "linear_schedule",
    "run",
    "train_compiled",
    "train_here",
]

log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    """The compiled run: its task, scheme, step and evaluator; with ``--compile-in child``
    also the model's buffer names and the skeleton ``RUN/model`` is written from."""

    task: recipes.Task
    scheme: Scheme
    choice: AutoChoice | None
    step: CompiledStep
    evaluator: Evaluator | None
    buffers: tuple[str, ...] | None = None
    skeleton: Path | None = None


def train_here(
    config: FinetuneConfig, given: Scheme | None, out: Path, saved: ckpt_io.Checkpoint | None,
    start: float,
) -> FinetuneResult:  # fmt: skip
    """``launch.run`` once ``out`` is held: build the task, choose the scheme (``given``;
    None: ``--scheme auto``), compile here, train."""
    compile_start = time.perf_counter()
    prepared = _prepare_here(config, given, saved)
    return _train(config, prepared, out, saved, start, time.perf_counter() - compile_start)


def train_compiled(
    config: FinetuneConfig, scheme: Scheme, out: Path, saved: ckpt_io.Checkpoint | None,
    starts: tuple[float, float], folder: Path, choice: dict[str, Any] | None = None,
) -> FinetuneResult:  # fmt: skip
    """``launch.run`` once its compile child has written ``folder``: load it, train.
    ``starts``: when the run and its compile started; ``choice``: ``--scheme auto``'s
    (``AutoChoice.to_dict``), made in a child too."""
    compiled = load_compiled(folder, config.backend)
    auto = AutoChoice.from_dict(choice) if choice is not None else None
    if auto is None and saved is not None and config.scheme == AUTO:
        auto = _resumed_choice(config, scheme)
    prepared = _Prepared(compiled.task, scheme, auto, compiled.step, compiled.evaluator,
                         compiled.buffers, compiled.skeleton)  # fmt: skip
    compile_s = time.perf_counter() - starts[1]
    return _train(config, prepared, out, saved, starts[0], compile_s)


def _prepare_here(
    config: FinetuneConfig, given: Scheme | None, saved: ckpt_io.Checkpoint | None
) -> _Prepared:
    """Task, scheme, step and evaluator, compiled in this process."""
    stages.say("loading the model and the data")
    task = recipes.build(config)
    stages.say(f"model and data ready: {task.train_size:,} training examples")
    scheme, choice = _scheme_of_run(config, task, given, saved)
    stages.say(f"compiling the training step and its evaluation ({config.backend} backend)")
    step = _compile(config, task, scheme)
    return _Prepared(task, scheme, choice, step, compile_evaluator_releasing(step, task))


def _train(
    config: FinetuneConfig, prepared: _Prepared, out: Path, saved: ckpt_io.Checkpoint | None,
    start: float, compile_s: float,
) -> FinetuneResult:  # fmt: skip
    """Train the prepared step, write ``RUN/model``, the adapter, the test metrics and the
    summary."""
    task, scheme, choice, step, evaluator = (prepared.task, prepared.scheme, prepared.choice,
                                             prepared.step, prepared.evaluator)  # fmt: skip
    report = step.report()
    loop = Loop(config, task, step, scheme, out, prepared.buffers)
    loop.evaluator = evaluator
    loop.info = RunInfo(out.name, _given(config.scheme), report.ours.trained_elements,
                        planned_peak_bytes=report.ours.planned_peak_bytes)  # fmt: skip
    if saved is not None:
        loop.restore(saved)  # a refused resume changes nothing in the folder
    write_report(out, str(report))
    with stop_on_signals() as stop:
        loop.train(stop)
    if prepared.skeleton is not None:
        write_from_skeleton(out, prepared.skeleton, task, released.step_values(step), config,
                            loop.best, loop.history, loop.global_step)  # fmt: skip
    else:
        home.write_model(out, task, released.step_values(step), config, loop.best,
                         loop.history, loop.global_step, changed=loop.changed)  # fmt: skip
    adapter.save_adapter(step, out / adapter.ADAPTER_DIR, base_model=task.home.get("source"))
    result = FinetuneResult(
        config=config,
        out=out,
        steps=loop.global_step,
        total_steps=loop.total,
        epochs_done=loop.epoch,
        stopped=stop.reason or loop.stopped,
        history=loop.history,
        report=str(report),
        notes=task.notes,
        wall_s=time.perf_counter() - start,
        compile_s=compile_s,
        step_s=loop.mean_step_s(),
        train_examples=task.train_size,
        val_examples=task.val_size,
        labels=task.labels,
        inputs=task.inputs,
        step=step,
        trained_params=report.ours.trained_elements,
        total_params=sum(math.prod(p.shape) for p in step.info.params),  # quantized too
        planned_peak_bytes=report.ours.planned_peak_bytes,
        peak_rss_bytes=peak_rss_bytes(),
        test=_test_metrics(step, task, evaluator) if not (loop.stopped or stop.reason) else {},
        auto_scheme=choice.to_dict() if choice is not None else None,
        scheme_lines=choice.lines() if choice is not None else [],
    )
    if result.finished:
        loop.log.append({"event": "summary", **result.to_dict()})
    ckpt_io.write_atomic(out / "summary.json", json.dumps(result.to_dict(), indent=2).encode())
    loop.curves.update(RunInfo.from_summary(out.name, result.to_dict()))
    loop.curves.wait()
    return result


def _scheme_of_run(
    config: FinetuneConfig,
    task: recipes.Task,
    given: Scheme | None,
    saved: ckpt_io.Checkpoint | None,
) -> tuple[Scheme, AutoChoice | None]:
    """The scheme given, or the one ``--scheme auto`` chooses (a resumed run keeps the
    one its checkpoint trained, and says the analysis was skipped)."""
    if given is not None:
        return given, None
    if saved is not None:
        scheme = schemes.from_dict(saved.scheme)
        return scheme, _resumed_choice(config, scheme)
    choice = choose_auto(config, task, recipes.RECIPES[recipes.recipe_name(config)].sparse)
    return choice.scheme, choice


def _resumed_choice(config: FinetuneConfig, scheme: Scheme) -> AutoChoice:
    """What a resumed ``--scheme auto`` run reports: the scheme its checkpoint trained."""
    choice = AutoChoice(scheme, float(config.memory_budget or 0), "the checkpoint", 0.0,
                        "resumed", 0.0)  # fmt: skip
    choice.notes.append("analysis skipped: --resume trains the scheme the run chose first")
    return choice


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
            log.info("released %.1f MiB of model weights the step holds (quantized or trained)",
                     freed / 2**20)  # fmt: skip
            release_free_memory()
    return evaluator


def _test_metrics(
    step: CompiledStep, task: recipes.Task, evaluator: Evaluator | None
) -> dict[str, float]:
    """The final weights' metrics on the test split (``--test-fraction``; else none)."""
    if not task.test:
        return {}
    metrics = evaluate(step, dataclasses.replace(task, val=task.test), evaluator=evaluator)
    return {f"test_{k.removeprefix('val_')}": v for k, v in metrics.items()}


def _given(value: str | None) -> str:
    assert value is not None, "filled in by the recipe's defaults"
    return value


def _compile(
    config: FinetuneConfig, task: recipes.Task, scheme: Scheme, frozen: FrozenWeights | None = None
) -> TrainStep:
    from pockengine.finetune.gguf import frozen_weights
    from pockengine.step.compiler import compile

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
        from pockengine.finetune.lm_buckets import compile_bucketed

        return compile_bucketed(one, task.train, task.buckets, config.batch_size)
    return one(example)


def remat_budget(config: FinetuneConfig) -> int | None:
    """The step's recomputation budget in bytes (``--remat-budget``; 0, "none": none)."""
    return int(config.remat_budget) if config.remat_budget else None


def compile_task(
    config: FinetuneConfig, task: recipes.Task, scheme: Scheme, frozen: FrozenWeights | None = None
) -> TrainStep:
    """The training step a run of ``config`` (defaults filled in) compiles for ``task``:
    the same batch shape, optimizer and scheme, for tools that rebuild a run's step
    (``pockengine export``). ``frozen``: ``gguf.frozen_weights(config)`` when the caller
    has read it already."""
    return _compile(config, task, scheme, frozen)
