"""Fine-tuning as ``pockengine finetune`` runs it: compile once, then a ``loop.Loop``.

``run(config)``: check the options, fill in the recipe's defaults, choose the scheme
(``--scheme auto`` analyses first), build the task, compile one ``TrainStep`` for the
fixed batch shape and the compiled evaluator (after which the model's copies of the
weights the step holds are released), resume from a checkpoint if asked, train
(``loop.Loop``: epochs, schedule, validation, checkpoints; SIGINT/SIGTERM stop it after
the current step with a checkpoint), then write ``RUN/model``, the adapter if any, the
test metrics and the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pockengine.evaluator import Evaluator
from pockengine.finetune import adapter, home, recipes, released
from pockengine.finetune import checkpoint as ckpt_io
from pockengine.finetune.auto_scheme import AUTO, AutoChoice, choose_auto
from pockengine.finetune.compile_child import compile_in_child
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.finetune.curves import RunInfo
from pockengine.finetune.loop import Loop, linear_schedule, stop_on_signals
from pockengine.finetune.metrics import compile_evaluator, evaluate
from pockengine.finetune.model_skeleton import write_from_skeleton
from pockengine.finetune.result import FinetuneResult, peak_rss_bytes, write_report
from pockengine.finetune.run_lock import RunLock
from pockengine.runtime import TrainStep, release_free_memory
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.step_base import CompiledStep

__all__ = ["compile_evaluator_releasing", "compile_task", "linear_schedule", "run"]

log = logging.getLogger(__name__)


def run(config: FinetuneConfig) -> FinetuneResult:
    """Fine-tune as ``config`` says; returns when done, stopped, or raises."""
    start = time.perf_counter()
    config = config.validate()
    config = config.with_defaults(recipes.defaults(config)).validate()
    given = _given(config.scheme)
    scheme = None if given == AUTO else recipes.parse_scheme(given, config.recipe)
    recipes.check_model_files(config)
    out = Path(config.out or Path("runs") / _slug(config))
    with RunLock(out):
        return _run_in(config, scheme, out, start)


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


def _run_in(
    config: FinetuneConfig, given: Scheme | None, out: Path, start: float
) -> FinetuneResult:
    """The run, once ``out`` is held: resume point, task, scheme, compile, train, summary."""
    saved = _resume_point(config, out)
    if config.compile_in == "child" and given is None:
        log.warning("--scheme auto analyses the model here: compiling here too")
    with contextlib.ExitStack() as stack:
        compile_start = time.perf_counter()
        if config.compile_in == "child" and given is not None:
            folder = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix=".compiled-", dir=out)))  # fmt: skip
            compiled = compile_in_child(config, given, folder)
            prepared = _Prepared(compiled.task, given, None, compiled.step, compiled.evaluator,
                                 compiled.buffers, compiled.skeleton)  # fmt: skip
        else:
            prepared = _prepare_here(config, given, saved)
        compile_s = time.perf_counter() - compile_start
        return _train(config, prepared, out, saved, start, compile_s)


def _prepare_here(
    config: FinetuneConfig, given: Scheme | None, saved: ckpt_io.Checkpoint | None
) -> _Prepared:
    """Task, scheme, step and evaluator, compiled in this process."""
    task = recipes.build(config)
    scheme, choice = _scheme_of_run(config, task, given, saved)
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
        choice = AutoChoice(scheme, float(config.memory_budget or 0), "the checkpoint", 0.0,
                            "resumed", 0.0)  # fmt: skip
        choice.notes.append("analysis skipped: --resume trains the scheme the run chose first")
        return scheme, choice
    choice = choose_auto(config, task, recipes.RECIPES[recipes.recipe_name(config)].sparse)
    return choice.scheme, choice


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


def _slug(config: FinetuneConfig) -> str:
    name = config.recipe or Path(str(config.model)).name or "model"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _resume_point(config: FinetuneConfig, out: Path) -> ckpt_io.Checkpoint | None:
    """The checkpoint to continue (``resume``), after checking it is this run's."""
    path = out / ckpt_io.CHECKPOINT
    ckpt_io.remove_stale_temporaries(out)
    if not config.resume:
        if path.exists():
            raise FinetuneError(
                f"{out} already holds a checkpoint: continue it with --resume, "
                "or choose another --out"
            )
        for stale in ("metrics.jsonl", "summary.json", home.BEST):  # never checkpointed
            (out / stale).unlink(missing_ok=True)
        return None
    saved = ckpt_io.load(path)
    now = json.loads(json.dumps(config.training_dict()))
    # an option newer than the checkpoint had its default then
    defaults = json.loads(json.dumps(FinetuneConfig().training_dict()))
    before = {**{k: v for k, v in defaults.items() if k not in saved.config}, **saved.config}
    diffs = [
        f"{k}: {before.get(k)!r} in the checkpoint, {v!r} now"
        for k, v in now.items()
        if before.get(k) != v
    ]
    if diffs:
        raise FinetuneError(
            "--resume continues a run with the options it started with; "
            "these differ:\n  " + "\n  ".join(diffs)
        )
    return saved


def _compile(config: FinetuneConfig, task: recipes.Task, scheme: Scheme) -> TrainStep:
    from pockengine.finetune.gguf import frozen_weights
    from pockengine.runtime import compile

    assert config.batch_size is not None
    example = tuple(torch.from_numpy(a[: config.batch_size]) for a in task.train)
    task.model.train()  # dropout on: its seed is the step's "rng.seed" state
    frozen = frozen_weights(config)
    return compile(
        task.model,
        task.loss_fn,
        example,
        optimizer=config.make_optimizer(),
        scheme=scheme,
        backend=config.backend,
        frozen_dtype=frozen.dtype,
        quantized=frozen.given,
        memory_budget=remat_budget(config),
    )


def remat_budget(config: FinetuneConfig) -> int | None:
    """The step's recomputation budget in bytes (``--remat-budget``; 0, "none": none)."""
    return int(config.remat_budget) if config.remat_budget else None


def compile_task(config: FinetuneConfig, task: recipes.Task, scheme: Scheme) -> TrainStep:
    """The training step a run of ``config`` (defaults filled in) compiles for ``task``:
    the same batch shape, optimizer and scheme, for tools that rebuild a run's step
    (``pockengine export``)."""
    return _compile(config, task, scheme)
