"""Contribution analysis: what each candidate update is worth, and what it costs.

Candidates (as in the paper, after MCUNetV3's contribution analysis): the biases (and
normalisation parameters) of a layer, and the weight of a layer at an output-channel
ratio r in ``RATIOS``. Each is measured by a short fine-tune (``steps`` steps at the
recipe's batch shape) on the training subset (``max_train`` examples), training that
candidate on top of a baseline, and evaluated on the last ``holdout`` examples of that
subset, held out from the fine-tune (the recipe's validation split is never seen, so
it can judge the searched scheme afterwards). A layer's biases train on top of the
head (baseline ``head``), a weight on top of every bias, norm and the head (baseline
``bias``). Its contribution is the gain
in validation accuracy over its baseline; its cost is read off the compiled training
step (``plan.report.analyze``): trained elements, backward FLOPs, saved-activation,
gradient and optimizer-state bytes and the planned peak, minus the baseline's.

Every candidate's step is compiled with ``pe.compile`` (its export, about 2 s for MiniLM, is
under 1% of a candidate's 30-step fine-tune) and starts from the same pretrained values
and the same batches.
Candidates run in ``os.cpu_count() - 1`` worker processes (at least one; one runs in
this process), with a tqdm bar. Each finished candidate is one JSON file in the cache
folder (written atomically), keyed by the analysis settings, so an interrupted analysis
resumes where it stopped.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pockengine.frontend.imported import ModelInfo
from pockengine.plan.report import Figures, analyze
from pockengine.safe_write import write_bytes
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme, scheme_named
from pockengine.tasks import data as ds
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = [
    "COST_FIELDS",
    "RATIOS",
    "Analysis",
    "AnalysisSettings",
    "Candidate",
    "Record",
    "StepBuilder",
    "candidates",
    "run_analysis",
]

log = logging.getLogger(__name__)

RATIOS = (0.125, 0.25, 0.5, 1.0)
COST_FIELDS = (
    "trained_elements",
    "backward_flops",
    "saved_activation_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "planned_peak_bytes",
)
_SKIP_TYPES = ("embedding",)  # rows of an embedding are tokens, not output channels


@dataclass(frozen=True)
class Candidate:
    """One update to measure: kind "bias" or "weight" of ``layer`` (a module path), or
    a "baseline" ("head" or "bias")."""

    kind: str
    layer: str
    params: tuple[str, ...] = ()
    ratio: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.layer}" + (f"@{self.ratio:g}" if self.kind == "weight" else "")

    @property
    def baseline(self) -> str:
        return {"bias": "head", "weight": "bias"}.get(self.kind, self.layer)


@dataclass(frozen=True)
class AnalysisSettings:
    """How each candidate is fine-tuned (the recipe's shapes, a subset of its data)."""

    steps: int = 30
    holdout: int = 200  # examples at the end of the training subset that score candidates
    lr: float | None = None  # None: the recipe's learning rate for the bias scheme
    threads: int | None = None  # torch threads a worker (None: cores / workers)

    def fingerprint(self, config: FinetuneConfig) -> str:
        facts = {
            "config": config.training_dict(),
            "steps": self.steps,
            "lr": self.lr,
            "backend": config.backend,
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Record:
    """What one candidate's short fine-tune measured (absolute figures)."""

    key: str
    kind: str
    layer: str
    ratio: float
    params: list[str]
    baseline: str
    val_accuracy: float
    val_loss: float
    costs: dict[str, int]
    seconds: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


@dataclass
class Analysis:
    """Baselines and candidate records, with contribution and cost over the baseline."""

    baselines: dict[str, Record]
    records: list[Record]
    folder: Path

    def contribution(self, r: Record) -> float:
        return r.val_accuracy - self.baselines[r.baseline].val_accuracy

    def extra(self, r: Record) -> dict[str, int]:
        base = self.baselines[r.baseline].costs
        return {k: r.costs[k] - base[k] for k in COST_FIELDS}

    def rows(self) -> list[dict[str, Any]]:
        return [
            {**dataclasses.asdict(r), "contribution": self.contribution(r), "extra": self.extra(r)}
            for r in self.records
        ]


def candidates(
    info: ModelInfo,
    layers: Sequence[str] = ("*",),
    ratios: Sequence[float] = RATIOS,
    biases: bool = True,
) -> list[Candidate]:
    """The candidates of a model: per layer (module path matching a ``layers`` glob; the
    head is in every baseline), its biases and its weight at each ratio."""
    head = schemes.head().resolve(info).names
    by_module: dict[str, list[Any]] = {}
    for p in info.params:
        if p.name not in head and any(fnmatch.fnmatchcase(p.module, g) for g in layers):
            by_module.setdefault(p.module, []).append(p)
    out = []
    for module, params in by_module.items():
        bias = tuple(p.name for p in params if p.is_bias or p.is_norm)
        if biases and bias:
            out.append(Candidate("bias", module, bias))
        if any(t in params[0].module_type.lower() for t in _SKIP_TYPES):
            continue
        for p in params:
            if not (p.is_bias or p.is_norm) and len(p.shape) >= 2:
                out += [Candidate("weight", module, (p.name,), float(r)) for r in ratios]
    if not out:
        raise FinetuneError(f"no candidate layer matches {list(layers)}")
    return out


# -- one process's work ---------------------------------------------------------------


class StepBuilder:
    """A task and its model: builds training steps for schemes, measures their cost and
    runs short fine-tunes."""

    def __init__(self, config: FinetuneConfig, settings: AnalysisSettings) -> None:
        self.config, self.settings = config, settings
        self.task = _held_out(recipes.build(config), settings.holdout, config.batch_size or 1)
        from pockengine.frontend.torch import torch_model_info

        self.info = torch_model_info(self.task.model)
        self.pristine = {k: v.clone() for k, v in self.task.model.state_dict().items()}
        # the baselines, as the scheme names "head" and "bias" (pockengine.sparse.schemes)
        self.head = sorted(scheme_named("head").resolve(self.info).names)
        self.bias = sorted(scheme_named("bias").resolve(self.info).names)

    def scheme(self, c: Candidate) -> Scheme:
        base = self.head if c.baseline == "head" else self.bias
        train = list(dict.fromkeys([*base, *c.params]))
        ratio = {p: c.ratio for p in c.params} if c.kind == "weight" and c.ratio < 1 else {}
        return schemes.select(train=train, channels=ratio, frozen_bn="eval")

    def step(self, scheme: Scheme, lr: float = 1e-3) -> Any:
        """The recipe's model compiled with ``pe.compile`` for ``scheme`` (from the pristine
        weights: ``measure`` restores them after each candidate)."""
        from pockengine.step.compiler import compile as compile_step

        assert self.config.batch_size is not None
        example = recipes.tensor_rows(self.task.train, 0, self.config.batch_size)
        self.task.model.train()
        optimizer = self.config.make_optimizer(lr)
        return compile_step(
            self.task.model,
            self.task.loss_fn,
            example,
            optimizer,
            scheme,
            backend=self.config.backend,
            compile_in="process",
        )

    def figures(self, scheme: Scheme) -> Figures:
        """The compiler's report of ``scheme`` (``TrainStep.report().ours``)."""
        return analyze(self.step(scheme).graph)

    def short_run(self, scheme: Scheme, lr: float) -> tuple[dict[str, float], Figures]:
        """``settings.steps`` steps of ``scheme`` at peak rate ``lr`` (linear warmup and
        decay), from the pretrained weights: the held-out metrics and the step's figures."""
        from pockengine.optim import linear_schedule
        from pockengine.tasks.metrics import evaluate

        step = self.step(scheme, lr)
        step.on_nonfinite = "skip"  # a run that diverges is scored, not fatal
        costs = analyze(step.graph)
        for t, batch in enumerate(self._batches()):
            step.lr = linear_schedule(t, lr, max(1, self.settings.steps // 10), self.settings.steps)
            step(*batch)
        try:
            return evaluate(step, self.task), costs
        finally:
            self.task.model.load_state_dict(self.pristine)

    def measure(self, c: Candidate) -> Record:
        start = time.perf_counter()
        lr = float(self.settings.lr or self.config.lr or 1e-3)
        metrics, costs = self.short_run(self.scheme(c), lr)
        return Record(
            c.key,
            c.kind,
            c.layer,
            c.ratio,
            list(c.params),
            c.baseline,
            metrics["val_accuracy"],
            metrics["val_loss"],
            {k: int(getattr(costs, k)) for k in COST_FIELDS},
            time.perf_counter() - start,
        )

    def _batches(self) -> Iterator[tuple[np.ndarray[Any, Any], ...]]:
        """``steps`` batches in the seeded epoch order, the same for every candidate."""
        size, n = self.config.batch_size or 1, self.task.train_size
        per_epoch = n // size
        for t in range(self.settings.steps):
            order = ds.epoch_order(n, self.config.seed, t // per_epoch)
            rows = order[(t % per_epoch) * size : (t % per_epoch + 1) * size]
            yield tuple(np.ascontiguousarray(a[rows]) for a in self.task.train)


def _held_out(task: recipes.Task, holdout: int, batch_size: int) -> recipes.Task:
    """The task with its last ``holdout`` training examples as its validation split: the
    recipe's own validation split stays unseen by the analysis (and by the search)."""
    keep = task.train_size - holdout
    if holdout < 1 or keep < batch_size:
        raise FinetuneError(
            f"{task.train_size} training examples cannot give {holdout} held-out ones and a "
            f"batch of {batch_size}; raise --max-train or lower the hold-out"
        )
    train = tuple(a[:keep] for a in task.train)
    return dataclasses.replace(task, train=train, val=tuple(a[keep:] for a in task.train))


_WORKER: StepBuilder | None = None


def _init_worker(config: FinetuneConfig, settings: AnalysisSettings, threads: int) -> None:
    global _WORKER
    torch.set_num_threads(threads)
    logging.getLogger("pockengine").setLevel(logging.WARNING)
    _WORKER = StepBuilder(config, settings)


def _measure_in_worker(c: Candidate) -> Record:
    assert _WORKER is not None
    return _WORKER.measure(c)


# -- the analysis -------------------------------------------------------------------


def analysis_config(config: FinetuneConfig, settings: AnalysisSettings) -> FinetuneConfig:
    """The config's recipe defaults filled in, at one learning rate for every candidate."""
    config = config.validate()
    recipes.check_model_files(config)  # nothing from a model folder runs, here either
    filled = config.with_defaults(recipes.defaults(dataclasses.replace(config, scheme="bias")))
    # The recipe's validation split is not used: one example keeps its loader cheap.
    return dataclasses.replace(
        filled, scheme="bias", lr=settings.lr or filled.lr, max_val=1
    ).validate()


def run_analysis(
    config: FinetuneConfig,
    settings: AnalysisSettings | None = None,
    *,
    layers: Sequence[str] = ("*",),
    ratios: Sequence[float] = RATIOS,
    workers: int | None = None,
    cache_dir: str | Path = "runs/sensitivity",
    progress: bool = True,
    builder: StepBuilder | None = None,
) -> Analysis:
    """Measure the baselines and every candidate not already in the cache."""
    settings = settings or AnalysisSettings()
    config = analysis_config(config, settings)
    folder = Path(cache_dir) / f"{recipes.recipe_name(config)}-{settings.fingerprint(config)}"
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes(
        folder / "settings.json",
        json.dumps(
            {"config": config.to_dict(), "settings": dataclasses.asdict(settings)}, indent=2
        ).encode(),
    )
    builder = builder or StepBuilder(config, settings)
    jobs = [
        Candidate("baseline", "head", tuple(builder.head)),
        Candidate("baseline", "bias", tuple(builder.bias)),
        *candidates(builder.info, layers, ratios),
    ]
    done = {c.key: r for c in jobs if (r := _cached(folder, c)) is not None}
    todo = [c for c in jobs if c.key not in done]
    log.info(
        "%d candidates: %d cached in %s, %d to measure", len(jobs), len(done), folder, len(todo)
    )
    for record in _measure_all(todo, config, settings, workers, progress, builder):
        write_bytes(_path(folder, record.key), json.dumps(dataclasses.asdict(record)).encode())
        done[record.key] = record
    baselines = {name: done[f"baseline:{name}"] for name in ("head", "bias")}
    analysis = Analysis(baselines, [done[c.key] for c in jobs if c.kind != "baseline"], folder)
    write_bytes(folder / "table.json", json.dumps(analysis.rows(), indent=1).encode())
    return analysis


def _path(folder: Path, key: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_.@" else "_" for ch in key)
    return folder / f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.json"


def _cached(folder: Path, c: Candidate) -> Record | None:
    path = _path(folder, c.key)
    try:
        return Record.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure_all(
    todo: Sequence[Candidate],
    config: FinetuneConfig,
    settings: AnalysisSettings,
    workers: int | None,
    progress: bool,
    builder: StepBuilder,
) -> Iterator[Record]:
    n = max(1, min(len(todo), workers or (os.cpu_count() or 2) - 1))
    bar = _bar(len(todo), progress)
    try:
        if n == 1 or len(todo) <= 1:
            if settings.threads:
                torch.set_num_threads(settings.threads)
            for c in todo:
                yield builder.measure(c)
                bar.update(1)
            return
        threads = settings.threads or max(1, (os.cpu_count() or n) // n)
        context = multiprocessing.get_context("spawn")  # torch is not fork-safe
        with cf.ProcessPoolExecutor(n, context, _init_worker, (config, settings, threads)) as pool:
            for future in cf.as_completed([pool.submit(_measure_in_worker, c) for c in todo]):
                yield future.result()
                bar.update(1)
    finally:
        bar.close()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, progress: bool) -> Any:
    if not progress or not total:
        return _NoBar()
    if importlib.util.find_spec("tqdm") is None:
        return _NoBar()
    tqdm: Any = importlib.import_module("tqdm")
    return tqdm.tqdm(total=total, unit="cand", desc="contribution analysis", dynamic_ncols=True)
