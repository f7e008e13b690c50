"""One run's training loop: the counters, the data order, the learning-rate schedule,
validation, best weights and checkpoints (``Loop``), and the signals that stop it.

``launch.run`` builds the task and the compiled step and hands them to a ``Loop``;
``Loop.train`` runs the epochs (a seeded order per epoch, the last partial batch
dropped), sets ``step.lr`` every step (linear warmup, then linear decay to zero), logs
a metrics line every ``log_every`` steps, validates at each epoch's end (the best
weights kept by ``home.BestWeights``) and writes a checkpoint every
``checkpoint_every`` steps and at each epoch's end; ``save``/``restore`` are the
checkpoint's two sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from pockengine.finetune.run_folder import adapter, home, released
from pockengine.finetune.run_folder import checkpoint as ckpt_io
from pockengine.finetune.run_folder.metrics_log import MetricsLog
from pockengine.finetune.running.curves import CurvesWriter, RunInfo
from pockengine.finetune.running.progress import Progress, make_progress
from pockengine.finetune.running.result import peak_rss_bytes
from pockengine.optim import linear_schedule
from pockengine.sparse.schemes import Scheme
from pockengine.step.evaluator import Evaluator
from pockengine.step.running import CompiledStep, NonFiniteError
from pockengine.tasks import data as ds
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.metrics import evaluate

__all__ = ["Loop", "StopFlag", "stop_on_signals"]

log = logging.getLogger(__name__)


class StopFlag:
    reason: str | None = None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """SIGINT/SIGTERM ask the loop to stop after the current step (a second SIGINT
    interrupts at once). Only the main thread can take signals."""
    flag = StopFlag()
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


class Loop:
    """The counters, the data order and the checkpoints of one run."""

    def __init__(
        self,
        config: FinetuneConfig,
        task: recipes.Task,
        step: CompiledStep,
        scheme: Scheme,
        out: Path,
        buffers: Sequence[str] | None = None,
    ) -> None:
        """``buffers``: the model's buffer names (default: ``task.model``'s; a step
        compiled in a child process brings them, as its task has no model)."""
        assert config.batch_size is not None and config.epochs is not None
        self.config, self.task, self.step, self.scheme = config, task, step, scheme
        self.batch_size = config.batch_size
        self.steps_per_epoch = task.train_size // config.batch_size
        self.total = config.epochs * self.steps_per_epoch
        self.warmup = round(config.warmup * self.total)
        self.global_step = self.epoch = self.batch = self.examples = 0
        self.order = task.epoch_order(config.seed, 0, config.batch_size)
        self.history: list[dict[str, Any]] = []
        self.fingerprint = ds.fingerprint(*task.train)
        self.path = out / ckpt_io.CHECKPOINT
        self.log = MetricsLog(out / "metrics.jsonl")
        self.best = home.BestWeights(out / home.BEST, task.kind)
        self.curves = CurvesWriter(out)  # curves.png, redrawn at each validation
        self.info = RunInfo(out.name)  # its legend (the trainer adds the report's figures)
        self.stopped: str | None = None
        self.evaluator: Evaluator | None = None  # compiled validation (else eager torch)
        self.buffers = (
            tuple(buffers)
            if buffers is not None
            else tuple(n for n, _ in task.model.named_buffers())
        )
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
            # the step's own memory, not copies: a full fine-tune's weights and AdamW state
            # copied at once were its run's peak (+1.6 GiB on SmolLM2-135M)
            self.step.flat_state_dict(self.step.written, copy=False),
            self.step.optimizer_state(copy=False),
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
        return home.changed_names(self.buffers, adapter.changed_in_model(self.step))

    def _load_checkpoint(self, saved: ckpt_io.Checkpoint) -> None:
        ckpt_io.load_into_step(self.step, saved, "this model")

    def train(self, stop: StopFlag) -> None:
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

    def _should_stop(self, stop: StopFlag) -> bool:
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
        self.order = self.task.epoch_order(self.config.seed, self.epoch, self.batch_size)
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
        log.warning(
            "resuming with %s: results may differ from an uninterrupted run in the last bits",
            ", ".join(diffs),
        )


def _count(value: int | None) -> int:
    assert value is not None
    return value
