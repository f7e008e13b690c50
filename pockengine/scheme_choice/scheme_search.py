"""``pockengine search``: contribution analysis, then the best scheme under a budget.

``search_scheme(config, memory_budget=..., flops_budget=...)`` runs (or reuses from its
cache) the contribution analysis of ``sensitivity``, turns each candidate into a
knapsack item (value: its accuracy gain; costs: its extra planned-peak bytes and
backward FLOPs over its baseline), chooses with ``scheme_choice.search.choose``, then compiles
the chosen scheme at the analysis shapes and repairs it until the compiler's own report
is within the budget (``fit_to_budget``). Writes the scheme file the fine-tuner reads
(``pockengine finetune --scheme FILE``), a JSON summary beside it and, with matplotlib,
a PNG of contribution against cost with the chosen candidates marked.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pockengine.plan.report import Figures
from pockengine.safe_write import write_bytes
from pockengine.scheme_choice.search import (
    Budget,
    Item,
    Selection,
    choose,
    fit_to_budget,
    scheme_for,
)
from pockengine.scheme_choice.sensitivity import (
    RATIOS,
    Analysis,
    AnalysisSettings,
    StepBuilder,
    analysis_config,
    run_analysis,
)
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = ["SearchResult", "choose_within", "items_from", "parse_amount", "search_scheme"]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_FLOP_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# budget key: figure (trained: elements a federated client sends, ``--upload-budget``)
_FIGURE_OF = {"memory": "planned_peak_bytes", "flops": "backward_flops",
              "trained": "trained_elements"}  # fmt: skip


def parse_amount(text: str, flops: bool = False) -> float:
    """``300MB``/``300MiB``/``300M`` (binary units, as the report prints MiB) or, for
    FLOPs, ``12G``/``12GFLOP`` (decimal units)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b|flops?)?\s*", text.lower())
    units: dict[str, float] = dict(_FLOP_UNITS) if flops else dict(_UNITS)
    if m is None or m.group(2) not in units:
        kind = "a FLOP count such as 12G" if flops else "a size such as 300MB"
        raise FinetuneError(f"cannot read {text!r} as {kind}")
    return float(m.group(1)) * units[m.group(2)]


def items_from(analysis: Analysis) -> list[Item]:
    """Knapsack items: a layer's weight ratios share a group; its biases are another."""
    items = []
    for r in analysis.records:
        extra = analysis.extra(r)
        items.append(
            Item(
                r.key,
                f"{r.kind}:{r.layer}",
                analysis.contribution(r),
                {"memory": extra["planned_peak_bytes"], "flops": extra["backward_flops"]},
                tuple(r.params),
                r.ratio,
            )
        )
    return items


@dataclass
class SearchResult:
    scheme: Scheme
    chosen: tuple[Item, ...]
    estimated: tuple[Item, ...]  # the knapsack's choice, before the compiler's check
    exact: bool
    measured: dict[str, float]
    budget: Budget
    analysis: Analysis
    shapes: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme.to_dict(),
            "budget": dict(self.budget.limits),
            "baseline_head": dict(self.budget.base),
            "measured": self.measured,
            "exact": self.exact,
            "shapes": self.shapes,
            "chosen": [
                {"key": i.key, "contribution": i.value, "extra": dict(i.cost)} for i in self.chosen
            ],
            "knapsack_choice": [i.key for i in self.estimated],
            "predicted_gain": sum(i.value for i in self.chosen),
            "cache": str(self.analysis.folder),
        }


def search_scheme(
    config: FinetuneConfig,
    memory_budget: float | None = None,
    flops_budget: float | None = None,
    *,
    settings: AnalysisSettings | None = None,
    layers: Sequence[str] = ("*",),
    ratios: Sequence[float] = RATIOS,
    workers: int | None = None,
    cache_dir: str | Path = "runs/sensitivity",
    out: str | Path | None = None,
    plot: str | Path | None = None,
    progress: bool = True,
) -> SearchResult:
    """The scheme of largest measured contribution within the budgets (bytes of the
    planned peak, backward FLOPs) as the compiler reports them at the config's shapes."""
    if memory_budget is None and flops_budget is None:
        raise FinetuneError("give a memory budget, a FLOPs budget, or both")
    settings = settings or AnalysisSettings()
    config = analysis_config(config, settings)
    builder = StepBuilder(config, settings)
    analysis = run_analysis(
        config,
        settings,
        layers=layers,
        ratios=ratios,
        workers=workers,
        cache_dir=cache_dir,
        progress=progress,
        builder=builder,
    )
    head = analysis.baselines["head"]
    budget = Budget(
        {"memory": memory_budget, "flops": flops_budget},
        {"memory": head.costs["planned_peak_bytes"], "flops": head.costs["backward_flops"]},
    )
    items = items_from(analysis)
    selection, chosen, measured = choose_within(
        items, budget, head.params, builder.figures, seed=config.seed
    )
    scheme = scheme_for(head.params, chosen)
    shapes = {k: getattr(config, k) for k in ("batch_size", "seq_len", "image_size")}
    result = SearchResult(
        scheme,
        chosen,
        selection.items,
        selection.exact,
        measured,
        budget,
        analysis,
        {k: v for k, v in shapes.items() if v is not None},
    )
    if out is not None:
        schemes.save(scheme, out)
        summary = Path(str(out) + ".search.json")
        write_bytes(summary, json.dumps(result.to_dict(), indent=2).encode())
    if plot is not None:
        from pockengine.sparse.plot import plot_contributions

        plot_contributions(
            analysis.rows(),
            [i.key for i in chosen],
            plot,
            title=f"{config.recipe}: {_budget_text(budget)}",
        )
    return result


def choose_within(
    items: Sequence[Item],
    budget: Budget,
    base: Sequence[str],
    figures: Callable[[Scheme], Figures],
    *,
    seed: int,
    max_additions: int = 16,
) -> tuple[Selection, tuple[Item, ...], dict[str, float]]:
    """The knapsack's pick of ``items`` within ``budget`` (estimated costs), then repaired
    until the compiler's ``figures`` of the whole scheme (the ``base`` parameters and the
    kept items) fit each limit of ``budget``: the pick, the kept items and their measured
    costs, keyed as the budget's limits (memory: planned peak, flops: backward FLOPs)."""
    selection = choose(items, budget, seed=seed)

    def measure(chosen: Sequence[Item]) -> dict[str, float]:
        measured = figures(scheme_for(base, chosen))
        return {key: getattr(measured, _FIGURE_OF[key]) for key in budget.limits}

    chosen, measured = fit_to_budget(selection, items, budget, measure, max_additions=max_additions)
    return selection, chosen, measured


def _budget_text(budget: Budget) -> str:
    parts = []
    if (m := budget.limits.get("memory")) is not None:
        parts.append(f"peak <= {m / (1 << 20):.0f} MiB")
    if (f := budget.limits.get("flops")) is not None:
        parts.append(f"backward <= {f / 1e9:.2f} GFLOP")
    return ", ".join(parts)
