"""Recomputation under a memory budget: activation checkpointing chosen by the planner.

``FitMemoryBudget(budget)`` is a training-graph pass. When the planned peak of the step
(``plan.memory``, after the passes that follow it, ``finish``) is above ``budget`` bytes,
it chooses saved forward values to recompute in the backward pass instead of keeping them
alive from the forward pass.

First by blocks (activation checkpointing of a transformer's layers): a repeated block is
a module path with a numeric component (``model.layers.3``), and its targets are the
saved values it makes that no forward node outside it reads (``block_targets``). What
crosses a boundary stays saved: the residual stream, and a mask or rotary table made once
for all layers. Recomputing a block's targets repeats the block from its input inside its
own backward pass (each value at its first backward reader), and its copies die there,
before the next block's backward. With every block checkpointed, the budget's room is
spent on keeping targets, in the order of ``passes.remat_select.keep_order`` (the last
block's first; in a block, the values that cost the most FLOPs per byte to recompute
first): the most of them whose plan meets the budget are kept (a binary search: a few
plans). A recomputed value is not made again while a copy of it lives
(``passes.remat_merge``). When even every block does not meet it, greedily, from the
graph as it was: the saved values alive at the planned peak, one by one the one whose
recomputation costs the fewest FLOPs per byte it frees there (its own size), costed with
the values chosen before it, enough to cover the excess over the budget, each kept only if
it and the earlier choices can all still be recomputed; then it plans again, until the
plan fits or nothing alive at the peak is left to try. Choices that lower no peak are not
kept: the pass tries the first half of them, down to one, and goes on from the lowest
plan found (recomputing many values at once can raise the peak where their chains'
operands are kept alive, and a budget far below reach asks for them all).
Unlike ``passes.remat`` any pure forward node may be repeated, matmuls and attention
included, through chains of values that died in the forward pass or were chosen
before, so choosing a transformer block's internals one by one ends in recomputing the
block from its input: activation checkpointing. The FLOPs estimate counts the nodes a
value's recomputation repeats (its producer, and the producers of its inputs that are not
alive in the backward pass, recursively); the peak is measured by planning again.

A budget the best plan cannot meet is not an error: the pass keeps the plan with the
lowest peak it found (of every block checkpointed and the greedy choice) and logs a
warning that names that peak, the smallest it reached, and how far it is from the budget;
``step.report()`` says the same (``recomputation``).

Recomputation repeats the original nodes (``passes.remat.recompute``): the same op,
attributes and operands, so every backend computes the same bits again. Dropout masks are
``random_mask`` nodes, a pure function of the step's seed (an optimizer-state input that
no effect writes before the backward pass), the salt and the element index, so a repeated
mask is the same mask. Effects (batch norm's running statistics, parameter updates) are
never repeated: only the pure values are.

Needs: a verified training graph whose backward nodes have ``Phase.BACKWARD`` and whose
effects come after the backward pass (run before ``reorder_updates``; ``with_budget``
puts it there). Guarantees: the same values, bit for bit, for every output and effect;
recomputed nodes have ``Phase.BACKWARD``, ``GRAD_PREFIX`` + the original source, and
results named ``<original>_re<k>``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pockengine.ir import GRAD_PREFIX, CompileError, Graph, Node, Phase, Value, get_op
from pockengine.passes.remat import recompute
from pockengine.passes.remat_merge import merge_recomputations
from pockengine.passes.remat_select import SavedValues, keep_order
from pockengine.plan.cost import cost
from pockengine.plan.memory import MemoryPlan, plan_memory
from pockengine.plan.recomputation import Recomputation, Segment

__all__ = [
    "BUDGET_DEPTH",
    "FitMemoryBudget",
    "Recomputation",
    "Segment",
    "block_inputs",
    "block_targets",
    "budget_of",
    "parse_budget",
    "recomputation",
    "with_budget",
]

log = logging.getLogger(__name__)
Pass = Callable[[Graph], Graph]
BUDGET_DEPTH = 64  # ops in one recomputed chain
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE = re.compile(r"\s*((?:[0-9]*\.)?[0-9]+(?:e\+?[0-9]+)?)\s*([kmg]?)(i?b)?\s*")
_MIB = 1 << 20


def parse_budget(budget: str | float | None) -> int | None:
    """Bytes from ``600MB``, ``600MiB``, ``1.5G`` (binary units, as the report prints MiB),
    or a number of bytes; None stays None."""
    if budget is None:
        return None
    if isinstance(budget, int | float) and not isinstance(budget, bool):
        value = float(budget)
    else:
        m = _SIZE.fullmatch(str(budget).lower())
        value = float(m.group(1)) * _UNITS[m.group(2)] if m else -1.0
    if not (value > 0 and math.isfinite(value)):
        raise CompileError(f"memory_budget: cannot read {budget!r} as a size > 0 such as '600MB'")
    return int(value)


def _pure(node: Node, v: Value) -> bool:
    return not get_op(node.op).effectful


def _finished(graph: Graph, finish: Sequence[Pass]) -> Graph:
    for p in finish:
        graph = p(graph)
    return graph


@dataclass(frozen=True)
class FitMemoryBudget:
    """The pass: recompute saved values until the planned peak of ``finish(graph)`` is at
    most ``budget`` bytes (see the module doc)."""

    budget: int
    finish: tuple[Pass, ...] = ()  # the passes after this one, whose result is planned
    __name__: ClassVar[str] = "fit_memory_budget"

    def peak(self, graph: Graph) -> int:
        return plan_memory(_finished(graph, self.finish)).planned_peak_bytes

    def __call__(self, graph: Graph) -> Graph:
        finished = _finished(graph, self.finish)
        plan = plan_memory(finished)
        base = plan.planned_peak_bytes
        if base <= self.budget:
            return graph
        saved = SavedValues.of(graph)
        blocked, blocked_plan = self._blocks(graph, saved, plan)
        if blocked_plan.planned_peak_bytes <= self.budget:
            return blocked
        best, best_peak = self._greedy(graph, saved, finished, plan)
        if best_peak <= self.budget:
            return best
        if blocked_plan.planned_peak_bytes < best_peak:
            best, best_peak = blocked, blocked_plan.planned_peak_bytes
        log.warning(
            "memory budget %.1f MiB not met: the best plan found peaks at %.1f MiB (%.1f MiB "
            "over; %.1f MiB without recomputation)",
            self.budget / _MIB,
            best_peak / _MIB,
            (best_peak - self.budget) / _MIB,
            base / _MIB,
        )
        return best

    def _greedy(
        self, graph: Graph, saved: SavedValues, finished: Graph, plan: MemoryPlan
    ) -> tuple[Graph, int]:
        """Saved values chosen one by one (the module doc); the lowest plan found, and its
        planned peak."""
        best, best_peak = graph, plan.planned_peak_bytes
        dropped, tried = set[str](), set[str]()
        while picks := self._picks(finished, plan, saved, dropped, tried):
            while True:  # fewer picks while they lower nothing: half of them, down to one
                current, now_dropped = _recompute(graph, dropped, picks)
                now_finished = _finished(current, self.finish)
                now_plan = plan_memory(now_finished)
                if now_plan.planned_peak_bytes < best_peak or len(picks) == 1:
                    break
                picks = picks[: len(picks) // 2]
            tried.update(picks)
            if now_plan.planned_peak_bytes < best_peak:  # go on from the lower plan only
                best, best_peak = current, now_plan.planned_peak_bytes
                dropped, finished, plan = now_dropped, now_finished, now_plan
            if best_peak <= self.budget:
                break
        return best, best_peak

    def _blocks(
        self, graph: Graph, saved: SavedValues, plan: MemoryPlan
    ) -> tuple[Graph, MemoryPlan]:
        """Block checkpointing: every repeated block's internals recomputed from its input
        (``block_targets``), less the most groups of ``keep_order`` (the values whose
        recomputation costs the most FLOPs per byte) that the budget leaves room for: a
        binary search over how many. With every block checkpointed over the budget, that
        plan (``graph`` itself when it plans no lower); the graph and its finished plan."""
        blocks = block_targets(graph, saved)
        if not blocks:
            return graph, plan
        every = set().union(*blocks)
        order = keep_order(saved, blocks)

        def trial(m: int) -> tuple[Graph, MemoryPlan]:
            current = _checkpointed(graph, every.difference(*order[:m]))
            return current, plan_memory(_finished(current, self.finish))

        found = trial(0)
        if found[1].planned_peak_bytes > self.budget:
            return found if found[1].planned_peak_bytes < plan.planned_peak_bytes else (graph, plan)
        lo, hi = 0, len(order) + 1  # keeping ``lo`` groups meets the budget, ``hi`` not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            now = trial(mid)
            if now[1].planned_peak_bytes <= self.budget:
                lo, found = mid, now
            else:
                hi = mid
        return found

    def _picks(
        self, graph: Graph, plan: MemoryPlan, saved: SavedValues, dropped: set[str], tried: set[str]
    ) -> list[str]:
        """The saved values alive at the planned peak of ``graph`` (finished) and first read
        by the backward after it, cheapest to recompute per byte first, enough of them to
        free the excess over the budget there (at least one)."""
        live, peak = plan.liveness, plan.planned_peak_bytes
        first: dict[str, int] = {}  # value -> its first backward reader
        for i, node in enumerate(graph.nodes):
            if node.phase is Phase.BACKWARD:
                for v in node.inputs:
                    first.setdefault(v.name, i)
        at_peak = [v.name for v in live.live_at(live.peak_index)]
        options = {
            n
            for n in at_peak
            if n in saved.saved and n not in tried and first.get(n, -1) > live.peak_index
        }
        order = {name: k for k, name in enumerate(saved.saved)}  # ties: the earliest saved
        picks: list[str] = []
        freed = 0
        while options and freed < peak - self.budget:  # each costed with the picks before it
            chosen = {*dropped, *picks}
            best = min(
                options,
                key=lambda n: (saved.estimate(n, chosen) / saved.saved[n].type.nbytes, order[n]),
            )
            options.remove(best)
            picks.append(best)
            freed += saved.saved[best].type.nbytes
        return picks


def _block_of(source: str) -> str | None:
    """The repeated block a node belongs to: its module path through the first numeric
    component (``model.layers.3`` of ``model.layers.3.mlp.up_proj``), or None."""
    m = _BLOCK.match(source)
    return m.group(1) if m else None


_BLOCK = re.compile(r"^(.*?\.[0-9]+)(?:\.|$)")


def block_inputs(graph: Graph) -> set[str]:
    """The forward values made outside a repeated block that a forward node of it reads:
    its input (the residual stream), a mask or rotary table made once for all blocks."""
    producers = graph.producers()
    out: set[str] = set()
    for node in graph.nodes:
        if node.phase is Phase.BACKWARD or get_op(node.op).effectful:
            continue
        block = _block_of(node.source)
        for v in node.inputs:
            made = producers.get(v.name)
            if block is not None and made is not None and _block_of(made.source) != block:
                out.add(v.name)
    return out


def block_targets(graph: Graph, saved: SavedValues | None = None) -> list[set[str]]:
    """The saved values inside each repeated block (a module path with a numeric
    component: a transformer layer), in forward order: made by the block and read by no
    forward node outside it. What crosses a block boundary (the residual stream, a mask
    or rotary table made once for all blocks) stays saved; recomputing the rest repeats the
    block from its input inside its backward, and frees it before the next block's."""
    saved = saved or SavedValues.of(graph)
    outside: set[str] = set()  # read in the forward pass by a node of another block
    for node in graph.nodes:
        if node.phase is Phase.BACKWARD or get_op(node.op).effectful:
            continue
        block = _block_of(node.source)
        for v in node.inputs:
            made = saved.producers.get(v.name)
            if made is not None and _block_of(made.source) != block:
                outside.add(v.name)
    blocks: dict[str, set[str]] = {}
    for node in graph.nodes:
        block = _block_of(node.source)
        for v in node.outputs:
            if block is not None and v.name in saved.saved and v.name not in outside:
                blocks.setdefault(block, set()).add(v.name)
    return list(blocks.values())


def _checkpointed(graph: Graph, targets: set[str]) -> Graph:
    """``graph`` with ``targets`` recomputed (any pure node repeated) from the blocks'
    inputs, kept alive where the backward does not read them (``block_inputs``), each
    recomputed value made once while a copy lives (``merge_recomputations``)."""
    out = recompute(graph, _pure, BUDGET_DEPTH, targets, keep=block_inputs(graph))
    return merge_recomputations(out)


def _recompute(graph: Graph, dropped: set[str], picks: Sequence[str]) -> tuple[Graph, set[str]]:
    """``graph`` with ``dropped`` and as many of ``picks`` (in order) as can join them
    recomputed, and the values recomputed. A pick is left saved when it cannot be
    recomputed with the others (its chain too deep: through a residual stream chosen
    before, back to the embedding; or an operand gone)."""
    out = _checkpointed(graph, dropped)
    for name in picks:
        trial = _checkpointed(graph, dropped | {name})
        read = {v.name for n in trial.nodes if n.phase is Phase.BACKWARD for v in n.inputs}
        if not (dropped | {name}) & read:
            out, dropped = trial, dropped | {name}
    return out, dropped


def budget_of(passes: Sequence[Pass]) -> int | None:
    """The memory budget (bytes) ``with_budget`` put among ``passes``, or None."""
    return next((p.budget for p in passes if isinstance(p, FitMemoryBudget)), None)


def with_budget(passes: Sequence[Pass], budget: int | None) -> tuple[Pass, ...]:
    """``passes`` with ``FitMemoryBudget(budget)`` before ``reorder_updates`` (or last);
    unchanged for no budget."""
    passes = tuple(p for p in passes if not isinstance(p, FitMemoryBudget))
    if budget is None:
        return passes
    names = [getattr(p, "__name__", "") for p in passes]
    at = names.index("reorder_updates") if "reorder_updates" in names else len(passes)
    return (*passes[:at], FitMemoryBudget(budget, passes[at:]), *passes[at:])


def _layer(sources: Sequence[str]) -> str:
    parts = [s.removeprefix(GRAD_PREFIX).split(".") for s in sources]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or "<several>"


def recomputation(
    passes: Sequence[Pass], stages: Sequence[tuple[str, Graph]]
) -> Recomputation | None:
    """What ``FitMemoryBudget`` among ``passes`` recomputed in the step whose pipeline
    stages (``run_pipeline``'s, input first) are ``stages``; None without a budget."""
    at = next((k for k, p in enumerate(passes) if isinstance(p, FitMemoryBudget)), None)
    if at is None:
        return None
    fit = passes[at]
    assert isinstance(fit, FitMemoryBudget)
    before, final = stages[at][1], stages[-1][1]
    made = {v.name for n in before.nodes for v in n.outputs}
    costs = cost(final)
    runs: list[list[int]] = []
    for i, node in enumerate(final.nodes):
        if node.outputs and node.outputs[0].name not in made:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    segments = tuple(
        Segment(
            _layer([final.nodes[i].source for i in run]),
            tuple(_ORIGINAL.sub("", final.nodes[i].outputs[0].name) for i in run),
            tuple(final.nodes[i].op for i in run),
            sum(costs.nodes[i].flops for i in run),
        )
        for run in runs
    )
    peak_after = plan_memory(final).planned_peak_bytes
    return Recomputation(fit.budget, fit.peak(before), peak_after, costs.flops, segments)


_ORIGINAL = re.compile(r"_re[0-9]+$")
