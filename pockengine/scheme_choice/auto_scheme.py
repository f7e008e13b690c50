"""``--scheme auto``: the gradient estimate, then the budgeted search, before a fine-tune.

``choose_auto(config, task, sparse)``: the base is what every sparse scheme trains
(classification: every bias and norm and the new head, the ``bias`` scheme; a causal
LM: every bias and norm, ``bias-only``, since its head is the tied embedding). The
budget is ``config.memory_budget`` (bytes of the planned peak), by default the planned
peak of the recipe's ``sparse`` scheme at the run's shapes. The candidates are the other
weights at the output-channel ratios of ``EstimateSettings``, valued by their share of
the estimate's total score (``estimate``), costed by their estimated extra bytes; the
knapsack of ``scheme_choice.search`` picks, and ``fit_to_budget`` repairs the pick against the
compiler's own planned peak (``Planner``: the training graph and its memory plan, no
backend). What was chosen and why (each weight's score, cost and ratio) goes into the
run's summary; so does a budget the choice leaves unused, or an analysis skipped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pockengine import status_lines
from pockengine.ir import SchemeError
from pockengine.optim import Optimizer
from pockengine.scheme_choice.estimate import (
    Estimate,
    EstimateSettings,
    Planner,
    WeightScore,
    cache_folder,
    cache_key,
    candidate_weights,
    estimate_scores,
    optimizer_of,
    save_cached,
)
from pockengine.scheme_choice.scheme_search import choose_within
from pockengine.scheme_choice.search import Budget, Item, scheme_for
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme, scheme_named
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.recipe_table import with_batchnorm
from pockengine.tasks.recipes import tensor_rows

__all__ = ["AUTO", "AutoChoice", "choose_auto", "items_from_estimate"]

log = logging.getLogger(__name__)
AUTO = "auto"  # the scheme name the fine-tuner resolves here
_MIB = float(1 << 20)
_SLACK = 0.9  # a measured peak under this fraction of the budget is reported as unused room


@dataclass
class AutoChoice:
    """The scheme ``auto`` chose, the budget it met and the evidence, for the summary."""

    scheme: Scheme
    budget_bytes: float
    budget_source: str
    planned_peak_bytes: float
    base: str
    base_peak_bytes: float
    candidates: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    estimate_seconds: float = 0.0
    cached: bool = False
    score: str = "fisher"
    # the most trained elements the scheme may hold (a federated client sends each one
    # every round: ``pockengine federated --upload-budget``); None: no limit
    upload_limit: float | None = None
    trained_elements: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["scheme"] = self.scheme.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoChoice:
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        return cls(**{**fields, "scheme": schemes.from_dict(data["scheme"])})

    def chosen(self) -> str:
        """What was chosen, in a few words: ``"bias + 8 of 36 weights"``."""
        trained = sum(1 for c in self.candidates if c["ratio"])
        return f"{self.base} + {trained} of {len(self.candidates)} weights"

    def lines(self, top: int = 8) -> list[str]:
        """A few lines for the printed summary: the choice, the budget, the best weights."""
        if not self.budget_bytes:  # resumed: the checkpoint's scheme, nothing analysed
            return [f"  auto scheme note: {n}" for n in self.notes]
        lines = [
            f"  auto scheme: {self.chosen()}; "
            f"planned peak {self.planned_peak_bytes / _MIB:.1f} MiB of a "
            f"{self.budget_bytes / _MIB:.1f} MiB budget ({self.budget_source}); analysis "
            f"{self.seconds:.1f} s{' (cached)' if self.cached else ''}",
        ]
        if self.upload_limit is not None:
            lines.append(
                f"  auto scheme: {self.trained_elements:,.0f} trained elements of an "
                f"upload budget of {self.upload_limit:,.0f}"
            )
        for c in sorted(self.candidates, key=lambda c: -c["share"])[:top]:
            mark = f"trained at ratio {c['ratio']:g}" if c["ratio"] else "frozen"
            lines.append(
                f"    {c['param']}: {self.score} share {c['share']:.3f}, "
                f"+{c['extra_mib']:.1f} MiB at ratio 1, {mark}"
            )
        lines += [f"  auto scheme note: {n}" for n in self.notes]
        return lines


def items_from_estimate(
    estimate: Estimate, kind: str, ratios: Sequence[float], optimizer: Optimizer
) -> list[Item]:
    """One knapsack group per weight (at most one ratio), valued by its share of the total
    score at ratio 1, costed by its estimated extra bytes and backward FLOPs."""
    total = sum(w.score(kind, 1.0) for w in estimate.weights) or 1.0
    slots = _state_slots(optimizer)
    items = []
    for w in estimate.weights:
        for r in ratios if w.partial else (1.0,):
            items.append(
                Item(
                    f"weight:{w.param}@{r:g}",
                    w.param,
                    w.score(kind, r) / total,
                    _extra(w, r, slots),
                    (w.param,),
                    float(r),
                )
            )
    return items


def _state_slots(optimizer: Optimizer) -> int:
    """Optimizer-state tensors per trained element (AdamW 2, SGD with momentum 1)."""
    return 2 if type(optimizer).__name__ == "AdamW" else int(getattr(optimizer, "momentum", 0) > 0)


def _extra(w: WeightScore, ratio: float, slots: int) -> dict[str, float]:
    trained = w.trained_rows(ratio) * (w.numel // max(1, w.shape[0]))
    memory = trained * 4 * (1 + slots) + w.saved_input_bytes
    flops = float(w.forward_flops * trained / max(1, w.numel))
    return {"memory": float(memory), "flops": flops, "trained": float(trained)}


def choose_auto(
    config: FinetuneConfig,
    task: Any,
    sparse: Scheme,
    settings: EstimateSettings | None = None,
    *,
    upload_limit: float | None = None,
) -> AutoChoice:
    """The scheme to train under the budget (see the module docstring), and with at most
    ``upload_limit`` trained elements where that is given; a choice made before for the
    same model, data, shapes, optimizer and budgets is read from the cache."""
    start = time.perf_counter()
    settings = (settings or EstimateSettings(score=config.auto_score)).check()
    facts = {"budget": config.memory_budget, "sparse": sparse.to_dict(), "kind": task.kind,
             "optimizer": [config.optimizer, config.momentum], "score": settings.score,
             "ratios": list(settings.ratios), "upload_limit": upload_limit}  # fmt: skip
    key = cache_key(config, task.train_fingerprint(), settings, **facts)
    path = cache_folder() / f"choice-{key}.json"
    try:
        choice = AutoChoice.from_dict(json.loads(path.read_text()))
        choice.cached = True
        status_lines.say(
            f"--scheme auto: the choice made before for this model, data and budget ({path})"
        )
    except (OSError, ValueError, KeyError, TypeError, SchemeError):
        status_lines.say(
            "--scheme auto: choosing what to train (planning the base scheme and the budget)"
        )
        choice = _choose(config, task, sparse, settings, upload_limit)
        save_cached(path, choice.to_dict())
    choice.seconds = time.perf_counter() - start
    log.info("auto scheme chosen in %.1f s", choice.seconds)
    if not choice.cached:
        status_lines.say(f"--scheme auto: {choice.chosen()} chosen in {choice.seconds:.1f} s")
    return choice


def _choose(
    config: FinetuneConfig,
    task: Any,
    sparse: Scheme,
    settings: EstimateSettings,
    upload_limit: float | None = None,
) -> AutoChoice:
    from pockengine.frontend.torch import import_torch, torch_model_info

    assert config.batch_size is not None
    example = tensor_rows(task.train, 0, config.batch_size)
    task.model.train()
    info = torch_model_info(task.model)
    model, loss_fn = task.model, task.loss_fn
    planner = Planner(
        info,
        lambda ev, rows: import_torch(model, loss_fn, [a[:rows] for a in example], ev),
        optimizer_of(config),
    )
    base_name = "bias-only" if task.kind == "causal-lm" else "bias"
    base = _mode(scheme_named(base_name, frozen_bn="eval"), config)
    base_figures = planner.figures(base)
    base_peak = float(base_figures.planned_peak_bytes)
    budget, source = _budget(config, planner, sparse)
    choice = AutoChoice(
        base,
        budget,
        source,
        base_peak,
        base_name,
        base_peak,
        score=settings.score,
        upload_limit=upload_limit,
        trained_elements=float(base_figures.trained_elements),
    )
    if upload_limit is not None and base_figures.trained_elements > upload_limit:
        raise FinetuneError(
            f"the upload budget ({upload_limit:,.0f} trained elements) is below what the "
            f"{base_name} scheme that auto starts from trains "
            f"({base_figures.trained_elements:,} elements): raise the budget, or train "
            "--scheme head"
        )
    if budget < base_peak:
        raise FinetuneError(
            f"--memory-budget {budget / _MIB:.1f} MiB is below the planned peak of the "
            f"{base_name} scheme that auto starts from ({base_peak / _MIB:.1f} MiB): raise the "
            "budget, or train --scheme head"
        )
    if config.memory_budget is not None:  # the default (sparse's peak) is below full's
        full = _mode(schemes.full(frozen_bn="eval"), config)
        full_figures = planner.figures(full)
        full_peak = float(full_figures.planned_peak_bytes)
        uploads = upload_limit is None or full_figures.trained_elements <= upload_limit
        if budget >= full_peak and uploads:
            choice.scheme, choice.planned_peak_bytes = full, full_peak
            choice.trained_elements = float(full_figures.trained_elements)
            choice.notes.append(
                f"analysis skipped: the budget allows full fine-tuning ({full_peak / _MIB:.1f} MiB)"
            )
            return choice
    _search(choice, config, task, planner, settings)
    log.info("auto scheme: %d planner calls", planner.calls)
    return choice


def _budget(config: FinetuneConfig, planner: Planner, sparse: Scheme) -> tuple[float, str]:
    if config.memory_budget is not None:
        return float(config.memory_budget), "--memory-budget"
    rule = _mode(dataclasses.replace(sparse, frozen_bn="eval"), config)
    return float(planner.figures(rule).planned_peak_bytes), "the sparse scheme's planned peak"


def _mode(scheme: Scheme, config: FinetuneConfig) -> Scheme:
    """``scheme`` with the run's BatchNorm mode (``--batchnorm``)."""
    return with_batchnorm(scheme, config.batchnorm)


def _search(
    choice: AutoChoice,
    config: FinetuneConfig,
    task: Any,
    planner: Planner,
    settings: EstimateSettings,
) -> None:
    """Estimate, choose, repair against the planner; fill in ``choice``."""
    base_names = sorted(choice.scheme.resolve(planner.info).names)
    weights = candidate_weights(planner.info, set(base_names))
    if not weights:
        choice.notes.append(f"analysis skipped: no weight outside the {choice.base} scheme")
        return
    estimate = estimate_scores(config, task, planner, weights, settings, choice.budget_bytes)
    items = items_from_estimate(estimate, settings.score, settings.ratios, planner.optimizer)
    budget = Budget({"memory": choice.budget_bytes}, {"memory": choice.base_peak_bytes})
    if choice.upload_limit is not None:
        budget = Budget(
            {**budget.limits, "trained": choice.upload_limit},
            {**budget.base, "trained": choice.trained_elements},
        )
    _, chosen, measured = choose_within(
        items,
        budget,
        base_names,
        lambda s: planner.figures(_mode(s, config)),
        seed=config.seed,
        max_additions=4,
    )
    choice.scheme = _mode(scheme_for(base_names, chosen), config)
    choice.planned_peak_bytes = float(measured["memory"])
    if "trained" in measured:
        choice.trained_elements = float(measured["trained"])
    choice.cached, choice.estimate_seconds = estimate.cached, estimate.seconds
    choice.candidates = _table(estimate, items, chosen, settings.score)
    _note_unused(choice, chosen, items)


def _table(
    estimate: Estimate, items: Sequence[Item], chosen: Sequence[Item], kind: str
) -> list[dict[str, Any]]:
    ratio = {i.group: i.ratio for i in chosen}
    at_one = {i.group: i for i in items if i.ratio == 1.0}
    return [
        {
            "param": w.param,
            "layer": w.layer,
            "share": at_one[w.param].value,
            "score": w.score(kind, 1.0),
            "extra_mib": at_one[w.param].cost["memory"] / _MIB,
            "ratio": ratio.get(w.param, 0.0),
        }
        for w in estimate.weights
    ]


def _note_unused(choice: AutoChoice, chosen: Sequence[Item], items: Sequence[Item]) -> None:
    """Say so when the choice leaves a good part of the budget unused."""
    if choice.planned_peak_bytes >= _SLACK * choice.budget_bytes:
        return
    left = {i.group for i in items} - {i.group for i in chosen}
    why = (
        f"{len(left)} weights left out did not fit when measured"
        if left
        else "every candidate weight is trained"
    )
    choice.notes.append(
        f"the scheme trains less than the budget allows: planned peak "
        f"{choice.planned_peak_bytes / _MIB:.1f} MiB of {choice.budget_bytes / _MIB:.1f} MiB "
        f"({why})"
    )
