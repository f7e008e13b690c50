"""The C step's memory plan: ``plan_memory`` with views sharing their source's buffer.

A result the step runs as a view (``views.step_views``: reshapes, and transposes whose
readers take them strided) gets no buffer of its own. One whose source is planned takes the
source's offset, and the source's buffer stays alive until the last reader of the source or
of any view of it (the two are placed as one interval, as an in-place chain is); a view of
a graph input (a param's transpose) reads the caller's memory and is not planned at all.
In-place reuse is ``reusable_inputs``'s, which already treats views as sharing their input's
buffer, so no result overwrites a source that a view still reads.
"""

from __future__ import annotations

import dataclasses

from pockengine.backends.c.views import View, step_views
from pockengine.ir import Graph
from pockengine.plan import MemoryPlan, plan_memory
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import Interval, Liveness, liveness
from pockengine.plan.memory import ALIGNMENT, place_intervals, reuse_groups

__all__ = ["plan_step_memory"]


def plan_step_memory(graph: Graph) -> MemoryPlan:
    """The arena plan of ``graph``'s C step."""
    reuse = reusable_inputs(graph)
    base = plan_memory(graph, reuse)
    views = step_views(graph)
    if not views:
        return base
    live = liveness(graph, reuse)
    head = reuse_groups(graph, reuse, live)
    for name, view in views.items():
        if view.root in live.intervals:
            head[name] = head.get(view.root, view.root)
    kept = {n: iv for n, iv in live.intervals.items() if n not in views or n in head}
    spans: dict[str, Interval] = {}
    for name, iv in kept.items():
        root = head.get(name, name)
        was = spans.get(root)
        spans[root] = iv if was is None else _union(was, iv)
    placed = place_intervals(list(spans.values()))
    at = {root: placed[span.value.name] for root, span in spans.items()}
    offsets = {name: at[head.get(name, name)] for name in kept}
    arena = max((at[r] + _aligned(s.nbytes) for r, s in spans.items() if s.nbytes), default=0)
    return dataclasses.replace(
        base,
        offsets=offsets,
        arena_bytes=arena,
        peak_live_bytes=_peak(live, views),
        liveness=Liveness(live.num_nodes, kept),
    )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _union(a: Interval, b: Interval) -> Interval:
    first = a if a.value.type.nbytes >= b.value.type.nbytes else b
    return Interval(first.value, min(a.start, b.start), max(a.end, b.end))


def _peak(live: Liveness, views: dict[str, View]) -> int:
    """The most bytes live at once, a view counting nothing and keeping its root alive."""
    spans = {n: iv for n, iv in live.intervals.items() if n not in views}
    for name, view in views.items():
        root, own = spans.get(view.root), live.intervals.get(name)
        if root is not None and own is not None and own.end > root.end:
            spans[view.root] = Interval(root.value, root.start, own.end)
    return Liveness(live.num_nodes, spans).peak_bytes
