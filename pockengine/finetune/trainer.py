"""The fine-tuning loop: compile once, then epochs of fixed-shape steps.

``run(config)``: check the options, fill in the recipe's defaults, build the task,
compile one ``TrainStep`` for the fixed batch shape, and train: a seeded order per
epoch (the last partial batch is dropped), the learning rate set through
``step.lr`` every step (linear warmup, then linear decay to zero), a metrics line
every ``log_every`` steps, validation at each epoch's end, a checkpoint every
``checkpoint_every`` steps and at each epoch's end. ``max_steps``, SIGINT and
SIGTERM stop the run after the current step with a checkpoint; ``resume`` continues
from it with the same data order, schedule position and dropout seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from pockengine.evaluator import Evaluator
from pockengine.finetune import adapter, home, recipes, released
from pockengine.finetune import checkpoint as ckpt_io
from pockengine.finetune import data as ds
from pockengine.finetune.auto_scheme import AUTO, AutoChoice, choose_auto
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.finetune.curves import CurvesWriter, RunInfo
from pockengine.finetune.metrics import MetricsLog, compile_evaluator, evaluate
from pockengine.finetune.progress import Progress, make_progress
from pockengine.finetune.result import FinetuneResult, peak_rss_bytes, write_report
from pockengine.finetune.run_lock import RunLock
from pockengine.optim import SGD, AdamW, Optimizer
from pockengine.runtime import NonFiniteError, TrainStep, release_free_memory
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme

__all__ = ["compile_task", "linear_schedule", "run"]

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


def _run_in(
    config: FinetuneConfig, given: Scheme | None, out: Path, start: float
) -> FinetuneResult:
    """The run, once ``out`` is held: resume point, task, scheme, compile, train, summary."""
    saved = _resume_point(config, out)
    task = recipes.build(config)
    scheme, choice = _scheme_of_run(config, task, given, saved)
    compile_start = time.perf_counter()
    step = _compile(config, task, scheme)
    evaluator = _evaluator(step, task)
    compile_s = time.perf_counter() - compile_start
    report = step.report()
    loop = _Loop(config, task, step, scheme, out)
    loop.evaluator = evaluator
    loop.info = RunInfo(out.name, _given(config.scheme), report.ours.trained_elements,
                        planned_peak_bytes=report.ours.planned_peak_bytes)  # fmt: skip
    if saved is not None:
        loop.restore(saved)  # a refused resume changes nothing in the folder
    write_report(out, str(report))
    with _stop_on_signals() as stop:
        loop.train(stop)
    home.write_model(out, task, released.step_values(step), config, loop.best, loop.history,
                     loop.global_step, changed=loop.changed)  # fmt: skip
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


def _evaluator(step: TrainStep, task: recipes.Task) -> Evaluator | None:
    """Validation compiled on the step (once per run); where it is, the model's float
    copies of the weights the step stores quantized, and of the params it trains (the step
    holds its own), are released: nothing reads them (``RUN/model`` is streamed from the
    step)."""
    evaluator = compile_evaluator(step, task)
    if evaluator is not None:
        own = dict(task.model.named_parameters())  # LoRA factors are the step's only
        trained = [n for n in step.trained if n in own]
        freed = released.release_quantized(task.model, step, also=trained)
        if freed:
            log.info("released %.1f MiB of model weights the step holds (quantized or trained)",
                     freed / 2**20)  # fmt: skip
            release_free_memory()
    return evaluator


def _test_metrics(
    step: TrainStep, task: recipes.Task, evaluator: Evaluator | None
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


def _optimizer(config: FinetuneConfig) -> Optimizer:
    lr = float(config.lr or 0.0)
    if config.optimizer == "sgd":
        return SGD(lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return AdamW(lr=lr, weight_decay=config.weight_decay)


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
        optimizer=_optimizer(config),
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


def linear_schedule(t: int, base: float, warmup: int, total: int) -> float:
    """The learning rate of step ``t`` (0-based): rising to ``base`` over ``warmup``
    steps, then falling linearly to zero at ``total``."""
    if t < warmup:
        return base * (t + 1) / warmup
    # After a warmup, whose last step already ran at ``base``, decay starts below it.
    return base * max(0.0, (total - t) / max(1, total - warmup + (warmup > 0)))


class _StopFlag:
    reason: str | None = None


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[_StopFlag]:
    """SIGINT/SIGTERM ask the loop to stop after the current step (a second SIGINT
    interrupts at once). Only the main thread can take signals."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def ask(signum: int, frame: FrameType | None) -> None:
        if flag.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.reason = signal.Signals(signum).name
        log.warning("%s: stopping after this step with a checkpoint", flag.reason)

    old = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class _Loop:
    """The counters, the data order and the checkpoints of one run."""

    def __init__(
        self, config: FinetuneConfig, task: recipes.Task, step: TrainStep, scheme: Scheme, out: Path
    ) -> None:
        assert config.batch_size is not None and config.epochs is not None
        self.config, self.task, self.step, self.scheme = config, task, step, scheme
        self.batch_size = config.batch_size
        self.steps_per_epoch = task.train_size // config.batch_size
        self.total = config.epochs * self.steps_per_epoch
        self.warmup = round(config.warmup * self.total)
        self.global_step = self.epoch = self.batch = self.examples = 0
        self.order = ds.epoch_order(task.train_size, config.seed, 0)
        self.history: list[dict[str, Any]] = []
        self.fingerprint = ds.fingerprint(*task.train)
        self.path = out / ckpt_io.CHECKPOINT
        self.log = MetricsLog(out / "metrics.jsonl")
        self.best = home.BestWeights(out / home.BEST, task.kind)
        self.curves = CurvesWriter(out)  # curves.png, redrawn at each validation
        self.info = RunInfo(out.name)  # its legend (the trainer adds the report's figures)
        self.stopped: str | None = None
        self.evaluator: Evaluator | None = None  # compiled validation (else eager torch)
        self._losses: list[float] = []
        self._times: list[float] = []
        self._all_times: list[float] = []
        self._started = time.perf_counter()

    # -- state -------------------------------------------------------------------------
    def _scheme_dict(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(json.dumps(self.scheme.to_dict()))
        return parsed

    def save(self) -> None:
        counters = {
            "step": self.global_step,
            "epoch": self.epoch,
            "batch": self.batch,
            "examples": self.examples,
        }
        info = {
            "fingerprint": self.fingerprint,
            "labels": list(self.task.labels),
            "history": self.history,
            "total_steps": self.total,
            "interval_losses": self._losses,
            "backend": self.config.backend,
            "threads": torch.get_num_threads(),
        }
        state = ckpt_io.Checkpoint(  # frozen weights are the model's own: not written
            self.step.flat_state_dict(self.step.written),
            self.step.optimizer_state(),
            self.order,
            counters,
            self.config.training_dict(),
            self._scheme_dict(),
            info,
        )
        try:
            ckpt_io.save(self.path, state)
        except OSError as exc:
            kept = "the previous one is intact" if self.path.exists() else "none was written"
            raise FinetuneError(
                f"cannot write the checkpoint {self.path} at step "
                f"{self.global_step} ({exc}); {kept}"
            ) from exc

    def restore(self, saved: ckpt_io.Checkpoint) -> None:
        if saved.info.get("fingerprint") != self.fingerprint:
            raise FinetuneError(
                "the training data differ from the checkpoint's; --resume needs the same dataset"
            )
        if saved.scheme != self._scheme_dict():
            raise FinetuneError(
                f"the scheme is now {self._scheme_dict()}, the checkpoint trained {saved.scheme}"
            )
        if len(saved.order) != self.task.train_size:
            raise FinetuneError("the checkpoint's data order does not fit the training split")
        self._load_checkpoint(saved)
        _warn_if_machine_differs(saved.info, self.config.backend)
        c = saved.counters
        self.global_step, self.epoch, self.batch = c["step"], c["epoch"], c["batch"]
        self.examples, self.order = c["examples"], saved.order
        self.history = list(saved.info.get("history", []))
        self.best.restore(self.global_step)
        self._losses = [float(x) for x in saved.info.get("interval_losses", [])]
        self.log.truncate_after(self.global_step)
        log.info(
            "resumed %s at step %d (epoch %d, batch %d)",
            self.path,
            self.global_step,
            self.epoch + 1,
            self.batch,
        )

    # -- the loop ------------------------------------------------------------------------
    @property
    def changed(self) -> list[str]:
        """The model's names whose values training changes (``home.changed_names``)."""
        return home.changed_names(self.task.model, adapter.changed_in_model(self.step))

    def _load_checkpoint(self, saved: ckpt_io.Checkpoint) -> None:
        """The values training changed (older checkpoints hold every param: the frozen
        ones are the model's, loaded as they are) and the whole optimizer state."""
        lacking = [n for n in self.step.written if n not in saved.params]
        if lacking:
            raise FinetuneError(f"the checkpoint does not fit this model: {len(lacking)} "
                                f"missing ({', '.join(lacking[:5])}), values training "
                                "changes")  # fmt: skip
        try:
            self.step.load_state(optimizer=saved.optimizer)
            result = self.step.load_state(saved.params, strict=False)
        except (KeyError, ValueError) as exc:
            raise FinetuneError(f"the checkpoint does not fit this model: {exc}") from exc
        if result.unexpected or result.mismatched:
            raise FinetuneError(f"the checkpoint does not fit this model: {result.describe()}")

    def train(self, stop: _StopFlag) -> None:
        progress = make_progress(
            self.config.progress, self.total, self.global_step, self.batch_size
        )
        try:
            while self.epoch < _count(self.config.epochs):
                while self.batch < self.steps_per_epoch:
                    if self._should_stop(stop):
                        self.save()
                        progress.message(
                            f"stopped at step {self.global_step} "
                            f"({self.stopped}); checkpoint {self.path}"
                        )
                        return
                    self._one_step(progress)
                    if (
                        self.global_step % self.config.checkpoint_every == 0
                        and self.batch < self.steps_per_epoch
                    ):
                        self.save()
                self._end_epoch(progress)
        finally:
            progress.close()

    def _should_stop(self, stop: _StopFlag) -> bool:
        limit = self.config.max_steps
        if stop.reason is not None:
            self.stopped = stop.reason
        elif limit is not None and self.global_step >= limit:
            self.stopped = "max_steps"
        return self.stopped is not None

    def _one_step(self, progress: Progress) -> None:
        rows = self.order[self.batch * self.batch_size : (self.batch + 1) * self.batch_size]
        batch = tuple(np.ascontiguousarray(a[rows]) for a in self.task.train)
        lr = linear_schedule(self.global_step, float(self.config.lr or 0), self.warmup, self.total)
        self.step.lr = lr
        start = time.perf_counter()
        try:
            loss = self.step(*batch)
        except NonFiniteError as exc:  # the step applied no update; nothing is saved
            raise FinetuneError(
                f"the loss is not finite at step {self.global_step + 1} ({exc}); the last "
                f"checkpoint is intact; try a lower --lr than {self.config.lr}"
            ) from exc
        self._times.append(time.perf_counter() - start)
        self.global_step += 1
        self.batch += 1
        self.examples += self.batch_size
        self._losses.append(loss)
        progress.update(loss, lr, self.epoch)
        if self.global_step % self.config.log_every == 0:
            self._log_train(lr)

    def _log_train(self, lr: float) -> None:
        if not self._losses:
            return
        seconds = sum(self._times)  # of this invocation's steps (a resumed interval has fewer)
        self.log.append(
            {
                "event": "train",
                "step": self.global_step,
                "epoch": round(self.epoch + self.batch / self.steps_per_epoch, 4),
                "loss": sum(self._losses) / len(self._losses),
                "lr": lr,
                "examples_per_s": len(self._times) * self.batch_size / seconds if seconds else 0.0,
                "step_s": seconds / len(self._times) if self._times else 0.0,
                "elapsed_s": time.perf_counter() - self._started,
            }
        )
        self._all_times += self._times
        self._losses, self._times = [], []

    def _end_epoch(self, progress: Progress) -> None:
        self._log_train(self.step.lr)
        metrics = evaluate(self.step, self.task, evaluator=self.evaluator)
        row = {"event": "eval", "step": self.global_step, "epoch": self.epoch + 1, **metrics}
        self.log.append(row)
        self.history.append(row)
        self.best.offer(row, released.step_values(self.step), self.changed)
        self.curves.update(dataclasses.replace(self.info, peak_rss_bytes=peak_rss_bytes()))
        progress.message(
            "epoch {}: {}".format(
                self.epoch + 1, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            )
        )
        self.epoch += 1
        self.batch = 0
        self.order = ds.epoch_order(self.task.train_size, self.config.seed, self.epoch)
        self.save()

    def mean_step_s(self) -> float:
        times = self._all_times + self._times
        return sum(times) / len(times) if times else 0.0


def _warn_if_machine_differs(info: dict[str, Any], backend: str) -> None:
    """Resuming on another backend or thread count continues the run, but its kernels
    sum in another order: say that results may differ in the last bits."""
    now = {"backend": backend, "threads": torch.get_num_threads()}
    diffs = [f"{k} {info[k]} -> {v}" for k, v in now.items() if k in info and info[k] != v]
    if diffs:
        log.warning("resuming with %s: results may differ from an uninterrupted run in the "
                    "last bits", ", ".join(diffs))  # fmt: skip


def _count(value: int | None) -> int:
    assert value is not None
    return value
