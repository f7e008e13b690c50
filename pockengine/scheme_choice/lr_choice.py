"""A learning rate chosen on the training split, never on the split that reports results.

``choose_lr(config, scheme, grid)``: for each rate of ``grid``, a short fine-tune of
``scheme`` (``sensitivity.StepBuilder.short_run``: ``steps`` steps, linear warmup and
decay, the run's batch shape and optimizer) on the training split less its last
``holdout`` examples, scored on those held-out training examples; the rate with the
lowest held-out loss wins (``criterion="loss"``, the default), or the best held-out
accuracy, ties broken by the loss (``criterion="accuracy"``; a causal LM: always the
loss). The loss is the default because on a few hundred held-out examples accuracy moves
in steps of one example: on minilm-bbc's reduced run it picked 1e-4 for full
fine-tuning (0.625 against 0.5 on 64 examples) where 1e-3 had the lower loss, and the
whole run did not converge at 1e-4 (docs/quality.md). The validation and test splits are
never read. ``--scheme auto`` is chosen first, on the
same reduced training split, and its rate is chosen for that scheme.

Short runs favour larger rates than a whole fine-tune would (they have fewer steps to
converge in), so the benchmark's grid stops where a whole run is known to diverge; the
rule and its grid are documented with the results (docs/quality.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pockengine.scheme_choice.auto_scheme import AUTO, choose_auto
from pockengine.scheme_choice.sensitivity import AnalysisSettings, StepBuilder
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = ["CRITERIA", "DEFAULT_GRID", "LrChoice", "choose_lr"]

DEFAULT_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
CRITERIA = ("loss", "accuracy")


@dataclass
class LrChoice:
    """The rate chosen, and every rate's held-out training metrics."""

    scheme: str
    lr: float
    trials: list[dict[str, Any]]
    seconds: float
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _prepared(config: FinetuneConfig, scheme: str) -> FinetuneConfig:
    """The config's recipe defaults for ``scheme``; no test split and a one-example
    validation split (neither is read: the held-out examples come from training)."""
    config = dataclasses.replace(config.validate(), scheme=scheme, lr=None)
    recipes.check_model_files(config)
    filled = config.with_defaults(recipes.defaults(config))
    return dataclasses.replace(filled, max_val=1, test_fraction=0.0).validate()


def _better(a: dict[str, float], b: dict[str, float], criterion: str) -> bool:
    """Whether held-out metrics ``a`` beat ``b`` (the loss; or accuracy, then loss)."""
    if criterion == "accuracy" and "val_accuracy" in a and a["val_accuracy"] != b["val_accuracy"]:
        return a["val_accuracy"] > b["val_accuracy"]
    return a["val_loss"] < b["val_loss"]


def choose_lr(
    config: FinetuneConfig,
    scheme: str,
    grid: Sequence[float] = DEFAULT_GRID,
    *,
    steps: int = 30,
    holdout: int = 200,
    criterion: str = "loss",
) -> LrChoice:
    """The rate of ``grid`` whose short run of ``scheme`` scores best on held-out training
    examples (see the module docstring)."""
    if not grid:
        raise FinetuneError("the learning-rate grid is empty")
    if criterion not in CRITERIA:
        raise FinetuneError(f"unknown lr criterion {criterion!r}: one of {', '.join(CRITERIA)}")
    start = time.perf_counter()
    config = _prepared(config, scheme)
    settings = AnalysisSettings(steps=steps, holdout=holdout)
    builder = StepBuilder(config, settings)
    if scheme == AUTO:
        sparse = recipes.RECIPES[recipes.recipe_name(config)].sparse
        chosen = choose_auto(config, builder.task, sparse).scheme
    else:
        chosen = recipes.parse_scheme(scheme, recipes.recipe_name(config), config.batchnorm)
    trials: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    for lr in grid:
        metrics, _ = builder.short_run(chosen, float(lr))
        trials.append({"lr": float(lr), **metrics})
        if best is None or _better(metrics, best, criterion):
            best = trials[-1]
    assert best is not None
    facts = {"steps": steps, "holdout": holdout, "grid": [float(x) for x in grid],
             "criterion": criterion,
             "train_examples": builder.task.train_size}  # fmt: skip
    return LrChoice(scheme, best["lr"], trials, time.perf_counter() - start, facts)
