"""Fine-tuning as ``pockengine finetune`` runs it: compile once, then a ``loop.Loop``.

``launch.run(config)`` checks the options, takes the run folder's lock and, with
``--compile-in child``, has a child compile; then ``train_compiled`` loads what the child
wrote, or ``train_here`` chooses the scheme (``--scheme auto`` analyses first), builds the
task, compiles one ``TrainStep`` for the fixed batch shape and the compiled evaluator
(``compiling.task_step``; after which the model's copies of the weights the step holds are
released). Either resumes from a checkpoint if asked, trains (``loop.Loop``: epochs,
schedule, validation, checkpoints; SIGINT/SIGTERM stop it after the current step with a
checkpoint), then writes ``RUN/model``, the adapter if any, the test metrics and the
summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pockengine import status_lines
from pockengine.finetune.compiling import task_step
from pockengine.finetune.compiling.compiled_task import load_compiled
from pockengine.finetune.compiling.model_skeleton import write_from_skeleton
from pockengine.finetune.compiling.task_step import compile_evaluator_releasing, compile_task
from pockengine.finetune.run_folder import adapter, home, released
from pockengine.finetune.run_folder import checkpoint as ckpt_io
from pockengine.finetune.running.curves import RunInfo
from pockengine.finetune.running.loop import Loop, stop_on_signals
from pockengine.finetune.running.result import FinetuneResult, peak_rss_bytes, write_report
from pockengine.scheme_choice.auto_scheme import AUTO, AutoChoice, choose_auto
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.step.evaluator import Evaluator
from pockengine.step.running import CompiledStep
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.metrics import evaluate

__all__ = [
    "compile_evaluator_releasing",
    "compile_task",
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
    config: FinetuneConfig,
    given: Scheme | None,
    out: Path,
    saved: ckpt_io.Checkpoint | None,
    start: float,
) -> FinetuneResult:
    """``launch.run`` once ``out`` is held: build the task, choose the scheme (``given``;
    None: ``--scheme auto``), compile here, train."""
    compile_start = time.perf_counter()
    prepared = _prepare_here(config, given, saved)
    return _train(config, prepared, out, saved, start, time.perf_counter() - compile_start)


def train_compiled(
    config: FinetuneConfig,
    scheme: Scheme,
    out: Path,
    saved: ckpt_io.Checkpoint | None,
    starts: tuple[float, float],
    folder: Path,
    choice: dict[str, Any] | None = None,
) -> FinetuneResult:
    """``launch.run`` once its compile child has written ``folder``: load it, train.
    ``starts``: when the run and its compile started; ``choice``: ``--scheme auto``'s
    (``AutoChoice.to_dict``), made in a child too."""
    compiled = load_compiled(folder, config.backend)
    auto = AutoChoice.from_dict(choice) if choice is not None else None
    if auto is None and saved is not None and config.scheme == AUTO:
        auto = _resumed_choice(config, scheme)
    prepared = _Prepared(
        compiled.task,
        scheme,
        auto,
        compiled.step,
        compiled.evaluator,
        compiled.buffers,
        compiled.skeleton,
    )
    compile_s = time.perf_counter() - starts[1]
    return _train(config, prepared, out, saved, starts[0], compile_s)


def _prepare_here(
    config: FinetuneConfig, given: Scheme | None, saved: ckpt_io.Checkpoint | None
) -> _Prepared:
    """Task, scheme, step and evaluator, compiled in this process."""
    status_lines.say("loading the model and the data")
    task = recipes.build(config)
    status_lines.say(f"model and data ready: {task.train_size:,} training examples")
    scheme, choice = _scheme_of_run(config, task, given, saved)
    status_lines.say(f"compiling the training step and its evaluation ({config.backend} backend)")
    step = task_step.compile_task(config, task, scheme)
    return _Prepared(task, scheme, choice, step, task_step.compile_evaluator_releasing(step, task))


def _train(
    config: FinetuneConfig,
    prepared: _Prepared,
    out: Path,
    saved: ckpt_io.Checkpoint | None,
    start: float,
    compile_s: float,
) -> FinetuneResult:
    """Train the prepared step, write ``RUN/model``, the adapter, the test metrics and the
    summary."""
    task, scheme, choice, step, evaluator = (prepared.task, prepared.scheme, prepared.choice,
                                             prepared.step, prepared.evaluator)  # fmt: skip
    report = step.report()
    loop = Loop(config, task, step, scheme, out, prepared.buffers)
    loop.evaluator = evaluator
    loop.info = RunInfo(
        out.name,
        _given(config.scheme),
        report.ours.trained_elements,
        planned_peak_bytes=report.ours.planned_peak_bytes,
    )
    if saved is not None:
        loop.restore(saved)  # a refused resume changes nothing in the folder
    write_report(out, str(report))
    with stop_on_signals() as stop:
        loop.train(stop)
    if prepared.skeleton is not None:
        write_from_skeleton(
            out,
            prepared.skeleton,
            task,
            released.step_values(step),
            config,
            loop.best,
            loop.history,
            loop.global_step,
        )
    else:
        home.write_model(
            out,
            task,
            released.step_values(step),
            config,
            loop.best,
            loop.history,
            loop.global_step,
            changed=loop.changed,
        )
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
    choice = AutoChoice(
        scheme, float(config.memory_budget or 0), "the checkpoint", 0.0, "resumed", 0.0
    )
    choice.notes.append("analysis skipped: --resume trains the scheme the run chose first")
    return choice


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
