"""Gradient contribution estimate: what each weight is worth, from a few backward passes.

The fine-tune-based analysis (``sensitivity``) fine-tunes once per candidate; this
estimate takes the gradients of ``batches`` batches, the last examples of the training
split (``TrainStep.gradients``, in micro-batches and groups of candidate weights, with
no optimizer state: ``gradient_sums``). Per output row (channel) of every weight it
keeps three scores, summed over the row:

- ``fisher``: the empirical Fisher, the mean over batches of g_b^2 (g_b: the batch-mean
  gradient of batch b);
- ``taylor``: first-order Taylor, |mean_b g_b * w|;
- ``grad``: |mean_b g_b|, what one AdamW step of size lr gains to first order, per
  element, since AdamW's first step moves each element by about lr * sign(g).

A weight at output-channel ratio r trains its leading ceil(r * rows) rows (the scheme's
``channels``), so its score is the sum over those rows. The costs of training it, over
the bias baseline, come from the run's imported graph: its gradient and optimizer-state
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
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pockengine import status_lines
from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo
from pockengine.ir import Graph, Role
from pockengine.optim import Optimizer
from pockengine.plan.cost import cost
from pockengine.plan.report import Figures, analyze
from pockengine.safe_write import write_bytes
from pockengine.sparse.schemes import Scheme
from pockengine.tasks.config import AUTO_SCORES, FinetuneConfig, FinetuneError

__all__ = [
    "SCORES",
    "Estimate",
    "EstimateSettings",
    "Planner",
    "WeightScore",
    "cache_folder",
    "estimate_scores",
    "optimizer_of",
    "save_cached",
]

log = logging.getLogger(__name__)
SCORES = AUTO_SCORES  # ("fisher", "taylor", "grad")
_SKIP_TYPES = ("embedding",)  # rows of an embedding are tokens, not output channels
_VIEWS = frozenset({"transpose", "reshape", "cast"})  # a weight read through these is still it
# Options that do not change what the model sees of the data (the scores' cache key).
_NOT_IN_KEY = ("scheme", "lr", "epochs", "memory_budget", "remat_budget", "warmup", "max_val",
               "val_fraction", "test_fraction", "optimizer", "momentum",
               "weight_decay", "auto_score")  # fmt: skip


@dataclass(frozen=True)
class EstimateSettings:
    """How many backward passes, which score ranks the weights, which ratios are offered."""

    batches: int = 2
    score: str = "fisher"
    ratios: tuple[float, ...] = (0.25, 0.5, 1.0)
    # examples per backward pass (a divisor of the batch size at most this): a batch's
    # gradient is the mean of its micro-batches' (docs/search.md: the analysis process
    # then holds less than the training one)
    micro_batch: int = 1
    # the candidates' gradients are taken in groups of at most this many bytes (one
    # backward pass per group and micro-batch): the process holds three arrays the size
    # of a group (a micro-batch's gradients, the batch's, the total), not of every weight;
    # larger groups where it would take more than max_groups (the passes' time)
    group_bytes: int = 8 << 20
    max_groups: int = 6

    def check(self) -> EstimateSettings:
        if self.score not in SCORES:
            raise FinetuneError(f"unknown score {self.score!r}: one of {', '.join(SCORES)}")
        counts = (self.batches, self.micro_batch, self.group_bytes, self.max_groups)
        if min(counts) < 1 or not all(0 < r <= 1 for r in self.ratios):
            raise FinetuneError(
                f"bad estimate settings {self}: batches, micro_batch, "
                "group_bytes and max_groups >= 1, ratios in (0, 1]"
            )
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
    rows: int = 0  # examples per backward pass (0: not recorded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": [dataclasses.asdict(w) for w in self.weights],
            "seconds": self.seconds,
            "examples": self.examples,
            "key": self.key,
            "rows": self.rows,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: Path) -> Estimate:
        weights = [WeightScore(**w) for w in data["weights"]]
        return cls(
            weights,
            data["seconds"],
            data["examples"],
            data["key"],
            True,
            str(path),
            rows=int(data.get("rows", 0)),
        )


def optimizer_of(config: FinetuneConfig, lr: float = 1e-3) -> Optimizer:
    """The run's optimizer at ``lr`` (its state counts in the planned peak; the rate does
    not, hence a fixed default)."""
    return config.make_optimizer(lr)


def cache_folder() -> Path:
    return Path(os.environ.get("PE_CACHE", "~/.cache/pockengine")).expanduser() / "sensitivity"


def save_cached(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` into the cache; a cache that cannot be written is only a warning
    (the run does not depend on it: a fresh machine has none)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, json.dumps(data).encode())
    except OSError as exc:
        log.warning("could not write the analysis cache %s: %s", path, exc)


def cache_key(
    config: FinetuneConfig, data_fingerprint: str, settings: EstimateSettings, **more: Any
) -> str:
    """What the scores depend on: the model, data and shapes of the config (not its lr,
    epochs or scheme), the data's fingerprint, the number of batches, and ``more``."""
    facts = {k: v for k, v in config.training_dict().items() if k not in _NOT_IN_KEY}
    facts |= {
        "data": data_fingerprint,
        "batches": settings.batches,
        "micro_batch": settings.micro_batch,
        "v": 5,
        **more,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- planning without a backend -----------------------------------------------------------


class Planner:
    """The compiler's figures (planned peak, backward FLOPs) of a scheme, from one import
    of the model (one per set of BatchNorms run on running statistics), with no backend.
    ``import_model(eval_modules, rows)`` imports the model on the first ``rows`` examples
    of the run's batch (None: all of it)."""

    def __init__(self, info: ModelInfo, import_model: Any, optimizer: Optimizer) -> None:
        self.info, self.optimizer = info, optimizer
        self._import = import_model
        self._imports: dict[frozenset[str], ImportedModel] = {}
        self._micro: dict[int, ImportedModel] = {}
        self.calls = 0

    def imported(self, eval_modules: frozenset[str] = frozenset()) -> ImportedModel:
        if eval_modules not in self._imports:
            self._imports[eval_modules] = self._import(set(eval_modules), None)
        return self._imports[eval_modules]

    def any_imported(self) -> ImportedModel:
        """An import of the whole batch, whichever BatchNorm mode it was made in (an
        import takes seconds; its shapes and what each weight reads are the same in
        every mode): the first made, else one with every BatchNorm training."""
        return next(iter(self._imports.values()), None) or self.imported()

    def gradient_step(self, backend: str, names: Sequence[str], rows: int) -> Any:
        """A step of a ``rows``-example micro-batch on ``backend`` that trains ``names``
        only, for ``TrainStep.gradients`` (``gradient_sums.gradient_step``)."""
        from pockengine.scheme_choice.gradient_sums import gradient_step
        from pockengine.step.parts import batchnorm_modules

        if rows not in self._micro:  # the run's own import where it is the whole batch
            # Every BatchNorm on its running statistics, so that a micro-batch's gradient
            # is the whole batch's share: on batch statistics a one-example micro-batch
            # normalises each example by itself (and a 1x1 feature map cannot be traced)
            batchnorms = frozenset(batchnorm_modules(self.info))
            whole = self.any_imported()
            same = bool(whole.batch) and whole.batch[0].type.shape[:1] == (rows,)
            self._micro[rows] = (
                self.imported(batchnorms) if same else self._import(set(batchnorms), rows)
            )
        return gradient_step(self._micro[rows], self.info, names, backend)

    def gradient_peak(self, names: Sequence[str]) -> int:
        """The planned peak (bytes) of ``gradient_step(..., names, rows)`` at the whole
        batch, from the compiler's plan (no backend)."""
        from pockengine.optim import SGD
        from pockengine.scheme_choice.gradient_sums import only
        from pockengine.step.parts import batchnorm_modules

        imported = self.imported(frozenset(batchnorm_modules(self.info)))
        return self._plan(imported, only(names), SGD(lr=0.0)).planned_peak_bytes

    def figures(self, scheme: Scheme) -> Figures:
        from pockengine.sparse.schemes import resolve_scheme
        from pockengine.step.parts import eval_batchnorms

        frozen = eval_batchnorms(self.info, resolve_scheme(scheme, self.info))
        return self._plan(self.imported(frozenset(frozen)), scheme, self.optimizer)

    def _plan(self, imported: ImportedModel, scheme: Scheme, optimizer: Optimizer) -> Figures:
        """The figures of ``scheme``'s training graph on ``imported`` (the compiler's
        passes and memory plan, no backend)."""
        from pockengine.ir import verify
        from pockengine.passes import DEFAULT_PIPELINE, FORWARD_PIPELINE, run_pipeline
        from pockengine.sparse.schemes import resolve_scheme
        from pockengine.step.compiler import apply_resolution, training_graph

        self.calls += 1
        resolution = resolve_scheme(scheme, self.info)
        forward = apply_resolution(imported.graph, resolution)
        forward = run_pipeline(verify(forward), FORWARD_PIPELINE).graph
        graph, _, _ = training_graph(forward, optimizer, resolution.rows)
        return analyze(run_pipeline(verify(graph), DEFAULT_PIPELINE).graph)


# -- the scores ---------------------------------------------------------------------------


def candidate_weights(info: ModelInfo, trained_anyway: set[str]) -> list[ParamInfo]:
    """Weights (2-D and up) outside the always-trained set: not an embedding table, unless
    it is also the output layer (``tied_head``)."""
    return [
        p
        for p in info.params
        if p.name not in trained_anyway
        and not (p.is_bias or p.is_norm)
        and len(p.shape) >= 2
        and (not any(t in p.module_type.lower() for t in _SKIP_TYPES) or tied_head(info, p))
    ]


def tied_head(info: ModelInfo, p: ParamInfo) -> bool:
    """Whether ``p`` is an embedding table tied to the model's head (a causal LM's output
    layer: ``lm_head.weight`` is ``embed_tokens.weight``). Its rows are then the output
    classes, the tokens, as a linear head's rows are: a candidate like any other output
    layer, whose partial update trains the leading rows (a BPE vocabulary's first ids,
    its earliest merges, are its most frequent tokens)."""
    return info.head is not None and any(
        alias.rsplit(".", 1)[0] == info.head
        for alias, name in info.canonical.items()
        if name == p.name
    )


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


def estimate_scores(
    config: FinetuneConfig,
    task: Any,
    planner: Planner,
    weights: Sequence[ParamInfo],
    settings: EstimateSettings,
    budget: float | None = None,
) -> Estimate:
    """The scores of ``weights`` (cached): the gradients of ``batches`` batches, the last
    ``batches * batch_size`` training examples, each in micro-batches
    (``gradient_sums``) of ``settings.micro_batch`` examples, or whole where the whole
    batch fits ``budget`` (``_micro_rows``)."""
    from pockengine.scheme_choice.gradient_sums import gradient_sums

    key = cache_key(config, task.train_fingerprint(), settings)
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
    reads = _reads(planner.any_imported().graph, {p.name for p in weights})
    scores = []
    total = sum(_nbytes(p) for p in weights)
    most = max(settings.group_bytes, -(-total // settings.max_groups))
    groups = _groups(weights, most)
    rows = _micro_rows(planner, groups, size, settings, budget)
    passes = len(groups) * n * (size // rows)
    status_lines.say(
        f"--scheme auto: scoring {len(weights)} weights on {n * size:,} training "
        f"examples: {len(groups)} group(s), {passes} backward passes"
    )
    for i, group in enumerate(groups, 1):
        if i > 1:
            status_lines.say(f"--scheme auto: {i - 1} of {len(groups)} groups scored")
        names = [p.name for p in group]
        step = planner.gradient_step(config.backend, names, rows)
        sums = gradient_sums(step, tail, rows, set(names))
        values = step.flat_state_dict(sums.total, copy=False)
        scores += [
            _weight_score(p, sums.rows(p.name, np.asarray(values[p.name])), reads)
            for p in group
            if p.name in sums.total
        ]
        del step, sums, values  # this group's activations and sums, before the next's
    estimate = Estimate(
        scores, time.perf_counter() - start, n * size, key, path=str(path), rows=rows
    )
    save_cached(path, estimate.to_dict())
    return estimate


def _micro_rows(
    planner: Planner,
    groups: Sequence[Sequence[ParamInfo]],
    size: int,
    settings: EstimateSettings,
    budget: float | None,
) -> int:
    """Examples per backward pass: the whole batch where its gradient step, plus the
    sums kept beside it (two arrays the size of the largest group), plans within
    ``budget`` less the model's own weights; else ``settings.micro_batch`` (the largest
    divisor of the batch at most that). The first group's step is the largest (its
    backward reaches furthest down).

    Why less the weights: the analysis runs in the compile child, which holds the float
    module it traces (and the framework, the tokenizer, the import) beside the step; the
    process that trains holds the step alone. At the run's budget itself the child
    would set the machine's peak: on the default minilm-bbc run (16 x 128 tokens) a
    whole-batch step planned 395 of the 423 MiB budget and the child peaked at 901 MiB,
    against 612 for the process that trains (docs/search.md). A whole batch
    is one pass where one-example micro-batches are ``size`` passes, and needs no
    second import of the model; none of the recipes fits it (SmolLM2: 1,318 MiB
    against 1,366 - 513)."""
    from pockengine.scheme_choice.gradient_sums import micro_rows

    floor = micro_rows(size, settings.micro_batch)
    if budget is None or floor == size or not groups:
        return floor
    sums = 2 * max(sum(_nbytes(p) for p in g) for g in groups)
    weights = sum(_nbytes(p) for p in planner.info.params)
    peak = planner.gradient_peak([p.name for p in groups[0]]) + sums
    fits = peak <= budget - weights
    log.info(
        "the estimate's whole-batch step plans %.1f MiB with its sums, %s the %.1f MiB "
        "budget less the model's %.1f MiB of weights: %d example(s) a pass",
        peak / 2**20,
        "within" if fits else "over",
        budget / 2**20,
        weights / 2**20,
        size if fits else floor,
    )
    return size if fits else floor


def _groups(weights: Sequence[ParamInfo], most: int) -> list[list[ParamInfo]]:
    """``weights`` in model order, cut into runs of at most ``most`` bytes (a larger weight
    alone): the later groups' backward passes stop early."""
    groups: list[list[ParamInfo]] = []
    size = most
    for p in weights:
        nbytes = _nbytes(p)
        if size + nbytes > most:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def _nbytes(p: ParamInfo) -> int:
    return 4 * int(np.prod(p.shape, dtype=np.int64))


def _weight_score(
    p: ParamInfo, rows: dict[str, list[float]], reads: Mapping[str, tuple[int, int]]
) -> WeightScore:
    saved, flops = reads.get(p.name, (0, 0))
    return WeightScore(p.name, p.module, list(p.shape), rows, saved, flops, p.channel_axis == 0)
