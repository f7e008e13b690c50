"""Gradient contribution estimate: what each weight is worth, from a few backward passes.

The fine-tune-based analysis (``sensitivity``) fine-tunes once per candidate; this
estimate compiles the task's model once with every parameter trainable (``pe.compile``,
scheme ``full``, no optimizer state) and runs ``batches`` backward passes
(``TrainStep.gradients``) on the last examples of the training split. Per output row
(channel) of every weight it keeps three scores, summed over the row:

- ``fisher``: the empirical Fisher, the mean over batches of g_b^2 (g_b: the batch-mean
  gradient of batch b);
- ``taylor``: first-order Taylor, |mean_b g_b * w|;
- ``grad``: |mean_b g_b|, what one AdamW step of size lr gains to first order, per
  element, since AdamW's first step moves each element by about lr * sign(g).

A weight at output-channel ratio r trains its leading ceil(r * rows) rows (the scheme's
``channels``), so its score is the sum over those rows. The costs of training it, over
the bias baseline, come from the same compiled graph: its gradient and optimizer-state
bytes (times r) plus the activation its weight gradient reads (the other inputs of the
nodes that read the weight), and r times the forward FLOPs of those nodes as backward
FLOPs. These are estimates: ``auto_scheme`` checks the chosen scheme against the
compiler's planned peak (``Planner``) and repairs it.

Scores are cached as one JSON file per (task, data fingerprint, settings) under
``$PE_CACHE/sensitivity`` (default ``~/.cache/pockengine``), written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.finetune.checkpoint import write_atomic
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo
from pockengine.ir import Graph, Role
from pockengine.optim import SGD, Optimizer
from pockengine.plan.cost import cost
from pockengine.plan.report import Figures, analyze
from pockengine.sparse.schemes import Scheme

__all__ = [
    "SCORES",
    "Estimate",
    "EstimateSettings",
    "Planner",
    "WeightScore",
    "cache_folder",
    "estimate_scores",
    "optimizer_of",
]

SCORES = ("fisher", "taylor", "grad")
_SKIP_TYPES = ("embedding",)  # rows of an embedding are tokens, not output channels
_VIEWS = frozenset({"transpose", "reshape", "cast"})  # a weight read through these is still it
# Options that do not change what the model sees of the data (the scores' cache key).
_NOT_IN_KEY = ("scheme", "lr", "epochs", "memory_budget", "remat_budget", "warmup", "max_val",
               "val_fraction", "test_fraction", "optimizer", "momentum",
               "weight_decay")  # fmt: skip


@dataclass(frozen=True)
class EstimateSettings:
    """How many backward passes, which score ranks the weights, which ratios are offered."""

    batches: int = 2
    score: str = "fisher"
    ratios: tuple[float, ...] = (0.25, 0.5, 1.0)

    def check(self) -> EstimateSettings:
        if self.score not in SCORES:
            raise FinetuneError(f"unknown score {self.score!r}: one of {', '.join(SCORES)}")
        if self.batches < 1 or not all(0 < r <= 1 for r in self.ratios):
            raise FinetuneError(f"bad estimate settings {self}: batches >= 1, ratios in (0, 1]")
        return self


@dataclass
class WeightScore:
    """One weight: per-row scores (each kind), and what training it costs per element and
    for its whole saved input."""

    param: str
    layer: str
    shape: list[int]
    rows: dict[str, list[float]]  # score kind -> per output row
    saved_input_bytes: int  # activations its weight gradient reads
    forward_flops: int  # of the nodes that read it
    partial: bool  # output channels on axis 0 (a ratio < 1 can apply)

    def score(self, kind: str, ratio: float) -> float:
        rows = self.rows[kind]
        return float(sum(rows[: self.trained_rows(ratio)]))

    def trained_rows(self, ratio: float) -> int:
        return len(self.rows[SCORES[0]]) if ratio >= 1 else max(1, math.ceil(ratio * self.shape[0]))

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Estimate:
    """The scores of every candidate weight, and how long they took to measure."""

    weights: list[WeightScore]
    seconds: float
    examples: int
    key: str
    cached: bool = False
    path: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": [dataclasses.asdict(w) for w in self.weights],
            "seconds": self.seconds,
            "examples": self.examples,
            "key": self.key,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: Path) -> Estimate:
        weights = [WeightScore(**w) for w in data["weights"]]
        return cls(weights, data["seconds"], data["examples"], data["key"], True, str(path))


def optimizer_of(config: FinetuneConfig, lr: float = 1e-3) -> Optimizer:
    """The run's optimizer at ``lr`` (its state counts in the planned peak; the rate does
    not, hence a fixed default)."""
    return config.make_optimizer(lr)


def cache_folder() -> Path:
    return Path(os.environ.get("PE_CACHE", "~/.cache/pockengine")).expanduser() / "sensitivity"


def cache_key(
    config: FinetuneConfig, data_fingerprint: str, settings: EstimateSettings, **more: Any
) -> str:
    """What the scores depend on: the model, data and shapes of the config (not its lr,
    epochs or scheme), the data's fingerprint, the number of batches, and ``more``."""
    facts = {k: v for k, v in config.training_dict().items() if k not in _NOT_IN_KEY}
    facts |= {"data": data_fingerprint, "batches": settings.batches, "v": 2, **more}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- planning without a backend -----------------------------------------------------------


class Planner:
    """The compiler's figures (planned peak, backward FLOPs) of a scheme, from one import
    of the model (one per set of BatchNorms run on running statistics), with no backend."""

    def __init__(self, info: ModelInfo, import_model: Any, optimizer: Optimizer) -> None:
        self.info, self.optimizer = info, optimizer
        self._import = import_model
        self._imports: dict[frozenset[str], ImportedModel] = {}
        self.calls = 0

    def imported(self, eval_modules: frozenset[str] = frozenset()) -> ImportedModel:
        if eval_modules not in self._imports:
            self._imports[eval_modules] = self._import(set(eval_modules))
        return self._imports[eval_modules]

    def gradient_step(self, backend: str) -> Any:
        """A step of the full scheme on ``backend`` from the same import (no second
        export), for ``TrainStep.gradients``; SGD without momentum keeps no state."""
        from pockengine.backends import get_backend
        from pockengine.runtime import TrainStep, apply_resolution
        from pockengine.sparse.schemes import full, resolve_scheme

        scheme = full(frozen_bn="eval")
        resolution = resolve_scheme(scheme, self.info)
        imported = self.imported()
        forward = apply_resolution(imported.graph, resolution)
        return TrainStep(imported, forward, SGD(lr=0.0), get_backend(backend), resolution,
                         self.info, scheme)  # fmt: skip

    def figures(self, scheme: Scheme) -> Figures:
        from pockengine.ir import verify
        from pockengine.passes import DEFAULT_PIPELINE, FORWARD_PIPELINE, run_pipeline
        from pockengine.runtime import apply_resolution, frozen_batchnorms, training_graph
        from pockengine.sparse.schemes import resolve_scheme

        self.calls += 1
        resolution = resolve_scheme(scheme, self.info)
        frozen = frozen_batchnorms(self.info, resolution) if resolution.frozen_bn_eval else set()
        forward = apply_resolution(self.imported(frozenset(frozen)).graph, resolution)
        forward = run_pipeline(verify(forward), FORWARD_PIPELINE).graph
        graph, _, _ = training_graph(forward, self.optimizer, resolution.rows)
        return analyze(run_pipeline(verify(graph), DEFAULT_PIPELINE).graph)


# -- the scores ---------------------------------------------------------------------------


def candidate_weights(info: ModelInfo, trained_anyway: set[str]) -> list[ParamInfo]:
    """Weights (2-D and up, not an embedding table) outside the always-trained set."""
    return [
        p
        for p in info.params
        if p.name not in trained_anyway
        and not (p.is_bias or p.is_norm)
        and len(p.shape) >= 2
        and not any(t in p.module_type.lower() for t in _SKIP_TYPES)
    ]


def _reads(graph: Graph, weights: set[str]) -> dict[str, tuple[int, int]]:
    """Per weight: bytes of the activations read beside it, and the FLOPs of those nodes.

    A weight is often read through a layout op first (``matmul(x, transpose(w))``): the
    outputs of ``_VIEWS`` of a weight stand for the weight, so ``x`` is what its gradient
    reads and the matmul's FLOPs are its own."""
    roles = {v.name: v.role for v in graph.inputs}
    flops = {id(n): c.flops for n, c in zip(graph.nodes, cost(graph).nodes, strict=True)}
    alias = {w: w for w in weights}
    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        read = {alias[v.name] for v in node.inputs if v.name in alias}
        if node.op in _VIEWS and len(read) == 1 and len(node.outputs) == 1:
            alias[node.outputs[0].name] = read.pop()
            continue
        for w in read:
            others = [
                v.type.nbytes
                for v in node.inputs
                if v.name not in alias and roles.get(v.name) not in (Role.PARAM, Role.CONST)
            ]
            saved, f = out.get(w, (0, 0))
            out[w] = (saved + sum(others), f + flops[id(node)])
    return out


def _row_scores(grads: Sequence[np.ndarray[Any, Any]], w: np.ndarray[Any, Any]) -> dict[str, Any]:
    g = np.stack([x.astype(np.float64) for x in grads])
    mean = g.mean(axis=0)
    axes = tuple(range(1, w.ndim))
    return {
        "fisher": (g**2).mean(axis=0).sum(axis=axes).tolist(),
        "taylor": np.abs(mean * w).sum(axis=axes).tolist(),
        "grad": np.abs(mean).sum(axis=axes).tolist(),
    }


def estimate_scores(
    config: FinetuneConfig,
    task: Any,
    planner: Planner,
    weights: Sequence[ParamInfo],
    settings: EstimateSettings,
) -> Estimate:
    """The scores of ``weights`` (cached): ``batches`` backward passes of the full scheme
    on the last ``batches * batch_size`` training examples."""
    from pockengine.finetune.data import fingerprint

    key = cache_key(config, fingerprint(*task.train), settings)
    path = cache_folder() / f"{key}.json"
    try:
        return Estimate.from_dict(json.loads(path.read_text()), path)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start = time.perf_counter()
    assert config.batch_size is not None
    size = config.batch_size
    n = min(settings.batches, task.train_size // size)
    if n < 1:
        raise FinetuneError(f"{task.train_size} training examples: fewer than one batch")
    tail = [tuple(a[-(b + 1) * size : len(a) - b * size] for a in task.train) for b in range(n)]
    step = planner.gradient_step(config.backend)
    grads, values = _gradients(step, tail, {p.name for p in weights})
    graph = step.forward
    reads = _reads(graph, {p.name for p in weights})
    scores = [_weight_score(p, grads[p.name], values[p.name], reads) for p in weights
              if p.name in grads]  # fmt: skip
    estimate = Estimate(scores, time.perf_counter() - start, n * size, key, path=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(estimate.to_dict()).encode())
    return estimate


def _weight_score(
    p: ParamInfo, grads: Sequence[Any], value: Any, reads: Mapping[str, tuple[int, int]]
) -> WeightScore:
    saved, flops = reads.get(p.name, (0, 0))
    rows = _row_scores(grads, value)
    return WeightScore(p.name, p.module, list(p.shape), rows, saved, flops, p.channel_axis == 0)


def _gradients(
    step: Any, batches: Sequence[tuple[Any, ...]], names: set[str]
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Per weight in ``names``: its gradient on each batch, and its value."""
    grads: dict[str, list[Any]] = {}
    for batch in batches:
        for name, g in step.gradients(*(np.ascontiguousarray(a) for a in batch)).items():
            if name in names:
                grads.setdefault(name, []).append(np.asarray(g))
    state = step.flat_state_dict(grads)
    return grads, {k: np.asarray(state[k]) for k in grads}
