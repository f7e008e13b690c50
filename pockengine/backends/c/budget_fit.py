"""The C step's arrangement, and what it gives up to meet a memory budget.

``arrange(graph, kernels, layouts)`` is the step as chosen: the layout pass applied
(``layout.apply_layouts``) and working memory added to the convolutions whose kernel
takes it (``workspace.add_workspaces``). Both add arena buffers that the training
pipeline's budget pass (``passes.remat_budget``, which plans the graph before the backend
sees it) does not plan: the converted maps and F(4x4, 3x3)'s transformed filters or
weight-gradient sums.

``fit_budget`` plans the arranged step (``plan_step.plan_step_memory``) and, while its
planned peak is above ``pe.compile(..., memory_budget=...)``'s budget, gives up first
working memory, one convolution at a time, the largest first (the node takes its fastest
measured kernel without working memory, else the rule's), then every NHWC and NCHW{c}c
layout. It keeps the first arrangement that fits, else the one with the lowest peak, and a warning
says how far that is from the budget. What it gives up costs time, never exactness: every
kernel and layout computes the same values within float32 rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from pockengine.backends.c.conv_kernels import (
    CONV_OPS,
    candidates,
    conv_geometry,
    node_kernel,
    rule_kernel,
)
from pockengine.backends.c.layout import apply_layouts, as_layouts
from pockengine.backends.c.plan_step import plan_step_memory
from pockengine.backends.c.workspace import WORK_KERNELS, add_workspaces, workspace_of
from pockengine.ir import Graph, Node
from pockengine.plan import MemoryPlan
from pockengine.plan.report import BackendMemory

__all__ = [
    "Arranged",
    "arrange",
    "export_candidates",
    "fit_budget",
    "kernel_without_work",
    "memory_of",
]

log = logging.getLogger(__name__)
_MIB = float(1 << 20)


@dataclass(frozen=True)
class Arranged:
    """The step the C backend emits: the graph after the layout pass with working memory
    added, the chosen kernel of each NCHW convolution (by first output), its arena plan,
    and one line for each thing a memory budget made it give up."""

    graph: Graph
    conv_kernels: dict[str, str]
    plan: MemoryPlan
    given_up: tuple[str, ...] = ()


def arrange(
    graph: Graph,
    kernels: Mapping[str, str],
    layouts: Collection[str] | Mapping[str, str],
    fast_gemm: bool = False,
) -> Arranged:
    """``graph`` (lowered for C) with the convolutions named in ``layouts`` in theirs
    (``layout.apply_layouts``: a mapping to NHWC or NCHW{c}c, or names for NHWC), each
    other convolution's kernel named (``kernels``' entry, else the rule's for a
    ``fast_gemm`` build or not) and its working memory added, planned."""
    chosen = as_layouts(layouts)
    laid = apply_layouts(graph, chosen)
    conv = {
        n.outputs[0].name: node_kernel(n, conv_geometry(n), kernels, fast_gemm)
        for n in graph.nodes
        if n.op in CONV_OPS and n.outputs[0].name not in chosen
    }
    worked = add_workspaces(laid, lambda n: (conv[n.outputs[0].name],))
    return Arranged(worked, conv, plan_step_memory(worked))


def kernel_without_work(
    node: Node, seconds: Mapping[str, float] | None = None, fast_gemm: bool = False
) -> str:
    """The kernel conv node ``node`` takes instead of one with working memory: the fastest
    of ``seconds`` (its measured candidates) that takes none, else the rule's."""
    g = conv_geometry(node)
    timed = {k: t for k, t in (seconds or {}).items()
             if k in candidates(node.op, g) and k not in WORK_KERNELS}  # fmt: skip
    if timed:
        return min(timed, key=timed.__getitem__)
    return rule_kernel(node.op, g, node.outputs[0].dtype.itemsize, WORK_KERNELS, fast_gemm)


def _least_given(
    order: Sequence[str], peak: Callable[[Collection[str]], int], budget: int
) -> tuple[list[str], bool]:
    """The fewest of ``order`` to give up for ``peak(given)`` to meet ``budget``: given up
    in that order until it does (or all are), then each taken back, the last first, where
    the peak stays within the budget (or, unmet, within the lowest peak reached); and
    whether the budget is met. Giving up working memory never raises a peak (it lives for
    its own node only), so the lowest is the one with all given up."""
    given: list[str] = []
    for name in order:
        given.append(name)
        if peak(given) <= budget:
            break
    bar = max(budget, peak(given))
    for name in reversed(list(given)):
        trial = [k for k in given if k != name]
        if peak(trial) <= bar:
            given = trial
    return given, bar == budget


def fit_budget(
    graph: Graph,
    kernels: Mapping[str, str],
    layouts: Collection[str] | Mapping[str, str],
    budget: int | None,
    seconds: Mapping[str, Mapping[str, float]] | None = None,
    fast_gemm: bool = False,
) -> Arranged:
    """The arrangement of ``graph`` whose planned peak meets ``budget`` bytes, giving up
    as little as the module docstring says; ``seconds``: each tuned node's measured
    candidates (by first output); ``fast_gemm``: the build's rule (``arrange``). With no
    budget, ``arrange``'s."""
    layouts = as_layouts(layouts)
    first = arrange(graph, kernels, layouts, fast_gemm)
    if budget is None or first.plan.planned_peak_bytes <= budget:
        return first
    worked = [(w.type.nbytes, n) for n in first.graph.nodes if (w := workspace_of(n)) is not None]
    worked.sort(key=lambda t: -t[0])
    named = {**kernels, **first.conv_kernels}  # every NCHW convolution's kernel, named
    instead, lines = {}, {}  # by first output: the kernel without working memory, and why
    for size, node in worked:
        name = node.outputs[0].name
        instead[name] = kernel_without_work(node, (seconds or {}).get(name), fast_gemm)
        lines[name] = (
            f"{node.op} {name}: {instead[name]} instead of {named[name]} "
            f"({size / _MIB:.2f} MiB of working memory)"
        )

    def with_given(
        given: Collection[str], laid: Collection[str] | Mapping[str, str] = layouts
    ) -> Arranged:
        chosen = {**named, **{k: instead[k] for k in given}}
        now = arrange(graph, chosen, laid, fast_gemm)
        return Arranged(now.graph, now.conv_kernels, now.plan, tuple(lines[k] for k in given))

    given, met = _least_given(list(instead), lambda g: with_given(g).plan.planned_peak_bytes,
                              budget)  # fmt: skip
    best = with_given(given)
    convs = [n for n in graph.nodes if n.op in CONV_OPS and n.outputs[0].name in layouts]
    if not met and convs:
        nchw = with_given(given, ())
        if nchw.plan.planned_peak_bytes < best.plan.planned_peak_bytes:
            kinds = " or ".join(sorted({layouts[n.outputs[0].name] for n in convs}))
            note = f"{len(convs)} convolutions in NCHW instead of {kinds} (no layout conversions)"
            best = Arranged(nchw.graph, nchw.conv_kernels, nchw.plan, (*nchw.given_up, note))
    if best.plan.planned_peak_bytes > budget:
        log.warning(
            "memory budget %.1f MiB not met by the C step: its plan peaks at %.1f MiB (%.1f "
            "MiB over) with %s",
            budget / _MIB,
            best.plan.planned_peak_bytes / _MIB,
            (best.plan.planned_peak_bytes - budget) / _MIB,
            "its kernels' working memory and layouts given up where that lowered it"
            if best.given_up
            else "nothing of its own left to give up",
        )
    return best


def memory_of(arranged: Arranged, budget: int | None = None) -> BackendMemory:
    """The report's account of the arranged step's memory (``step.report()``)."""
    works = [w for n in arranged.graph.nodes if (w := workspace_of(n)) is not None]
    converted = [n.outputs[0] for n in arranged.graph.nodes if n.op == "layout_convert"]
    return BackendMemory(
        "C",
        arranged.plan.planned_peak_bytes,
        arranged.plan.arena_bytes,
        sum(w.type.nbytes for w in works),
        len(works),
        sum(v.type.nbytes for v in converted),
        len(converted),
        budget,
        arranged.given_up,
    )


def export_candidates(graph: Graph, budget: int | None) -> dict[str, tuple[str, ...]]:
    """The kernels each conv node of an exported trainer's ``graph`` (after its layout
    pass) may switch to (``./train --tune``), by first output: every valid one, less
    F(4x4, 3x3) where a ``budget`` (bytes) leaves no room for its working memory, which
    the trainer plans for every candidate (the largest first, then each taken back that
    the budget did not need, as ``fit_budget`` does)."""
    convs = [n for n in graph.nodes if n.op in CONV_OPS]
    cands = {n.outputs[0].name: candidates(n.op, conv_geometry(n)) for n in convs}

    def kept(given: Collection[str]) -> dict[str, tuple[str, ...]]:
        return {k: tuple(c for c in v if k not in given or c not in WORK_KERNELS)
                for k, v in cands.items()}  # fmt: skip

    def peak(given: Collection[str]) -> int:
        allowed = kept(given)
        worked = add_workspaces(graph, lambda n: allowed[n.outputs[0].name])
        return plan_step_memory(worked).planned_peak_bytes

    if budget is None or peak(()) <= budget:
        return cands
    sized = [
        (w.type.nbytes, n.outputs[0].name)
        for n in add_workspaces(graph, lambda n: cands[n.outputs[0].name]).nodes
        if (w := workspace_of(n)) is not None
    ]
    given, met = _least_given([k for _, k in sorted(sized, key=lambda t: -t[0])], peak, budget)
    if not met:
        log.warning(
            "memory budget %.1f MiB not met by the exported trainer: its plan peaks at %.1f "
            "MiB with F(4x4, 3x3)'s working memory given up",
            budget / _MIB,
            peak(given) / _MIB,
        )
    return kept(given)
