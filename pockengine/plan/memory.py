"""The static memory plan: one arena for every non-persistent value, offsets fixed at
compile time.

Every node result and batch input with a non-zero size gets an offset in one arena,
aligned to ``ALIGNMENT`` bytes, such that two values whose lifetimes overlap (see
``plan.liveness``) never overlap in memory. Placement is greedy by size with best
fit: values are placed largest first, each into the smallest gap left between the
values already placed that are alive at the same time (the "greedy by size" planner
of TFLite). The arena is at least the peak of live bytes, which is the lower bound
for any placement; ``arena_bytes - peak_live_bytes`` is the fragmentation cost.

In-place reuse is planned as the torch backend runs it: an elementwise result that
``plan.inplace.reusable_inputs`` lets overwrite a dying input takes that input's place
(its lifetime ends just before the node) at exactly the input's offset: the chain is
placed as one value, so the C backend, which runs the plan's offsets as they are, writes
each element over the one it reads. Otherwise conservative: a value that a backend
would make a view (reshape, transpose, broadcast_to, slice) still gets a buffer of its own.

Persistent values (params, buffers, consts, optimizer state) live outside the arena
for the whole run; they are reported by role.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pockengine.ir import Graph, Role
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import Interval, Liveness, liveness

__all__ = ["ALIGNMENT", "MemoryPlan", "place_intervals", "plan_memory", "reuse_groups"]

ALIGNMENT = 64  # bytes; every offset is a multiple of it


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class MemoryPlan:
    """Where every non-persistent value lives, and how many bytes the step needs."""

    offsets: dict[str, int]  # value name -> byte offset in the arena
    arena_bytes: int
    peak_live_bytes: int  # the most non-persistent bytes alive at once: arena's lower bound
    param_bytes: int  # every param, trained or frozen
    trained_param_bytes: int
    buffer_bytes: int
    const_bytes: int
    state_bytes: int  # optimizer state (moments, lr, step count) and the rng seed
    liveness: Liveness

    @property
    def persistent_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes + self.const_bytes + self.state_bytes

    @property
    def planned_peak_bytes(self) -> int:
        return self.arena_bytes + self.persistent_bytes

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"planned peak {self.planned_peak_bytes / mib:.2f} MiB = arena "
            f"{self.arena_bytes / mib:.2f} MiB (live peak {self.peak_live_bytes / mib:.2f} MiB)"
            f" + persistent {self.persistent_bytes / mib:.2f} MiB (params "
            f"{self.param_bytes / mib:.2f}, trained {self.trained_param_bytes / mib:.2f}, "
            f"buffers {self.buffer_bytes / mib:.2f}, consts {self.const_bytes / mib:.2f}, "
            f"optimizer state {self.state_bytes / mib:.2f})"
        )


def _best_fit(busy: list[tuple[int, int]], size: int) -> int:
    """The start of the smallest gap of at least ``size`` bytes among busy ranges."""
    best, best_gap, cursor = -1, -1, 0
    for lo, hi in sorted(busy):
        gap = lo - cursor
        if gap >= size and (best_gap < 0 or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, hi)
    return best if best >= 0 else cursor


def place_intervals(intervals: list[Interval]) -> dict[str, int]:
    """``ALIGNMENT``-aligned offsets for ``intervals``, largest first, each in the tightest
    free gap, so that two intervals that overlap in time never overlap in memory (the plan's
    arena; the torch backend's workspace places its own intervals with it)."""
    order = sorted(intervals, key=lambda iv: (-iv.nbytes, iv.start, iv.value.name))
    n = len(order)
    starts, ends = np.empty(n, np.int64), np.empty(n, np.int64)
    lows, highs = np.empty(n, np.int64), np.empty(n, np.int64)
    offsets: dict[str, int] = {}
    for k, iv in enumerate(order):
        size = _aligned(iv.nbytes)
        alive = (starts[:k] <= iv.end) & (ends[:k] >= iv.start)
        busy = list(zip(lows[:k][alive].tolist(), highs[:k][alive].tolist(), strict=True))
        offset = _best_fit(busy, size)
        starts[k], ends[k], lows[k], highs[k] = iv.start, iv.end, offset, offset + size
        offsets[iv.value.name] = offset
    return offsets


def reuse_groups(graph: Graph, reuse: Mapping[int, int], live: Liveness) -> dict[str, str]:
    """Value -> the first value of its in-place chain, for every result that takes a dying
    input's buffer (its lifetime ended just before the node: ``liveness``)."""
    head: dict[str, str] = {}
    for i, k in sorted(reuse.items()):
        node = graph.nodes[i]
        src, out = node.inputs[k].name, node.outputs[0].name
        iv = live.intervals.get(src)
        if iv is not None and iv.end == i - 1 and iv.nbytes == live.intervals[out].nbytes:
            head[out] = head.get(src, src)
    return head


def _place_groups(intervals: list[Interval], head: Mapping[str, str]) -> dict[str, int]:
    """``_place`` with each in-place chain as one interval: a result that overwrites its
    input gets exactly the input's offset. (Placed apart, the two could overlap at a shift,
    and a kernel writing element i would clobber input elements not yet read.)"""
    spans: dict[str, Interval] = {}
    for iv in intervals:
        root = head.get(iv.value.name, iv.value.name)
        was = spans.get(root)
        spans[root] = (
            iv
            if was is None
            else Interval(was.value, min(was.start, iv.start), max(was.end, iv.end))
        )
    placed = place_intervals(list(spans.values()))
    rep = {root: span.value.name for root, span in spans.items()}
    return {iv.value.name: placed[rep[head.get(iv.value.name, iv.value.name)]] for iv in intervals}


def _bytes(graph: Graph, role: Role, trained_only: bool = False) -> int:
    values = graph.inputs_with_role(role)
    return sum(v.type.nbytes for v in values if v.trainable or not trained_only)


def plan_memory(graph: Graph, reuse: Mapping[int, int] | None = None) -> MemoryPlan:
    """Place every non-persistent value of ``graph`` in one arena; ``reuse`` (node index ->
    input position, default ``reusable_inputs(graph)``) says which results overwrite an
    input; ``{}`` plans no in-place reuse."""
    reuse = reusable_inputs(graph) if reuse is None else reuse
    live = liveness(graph, reuse)
    planned = [iv for iv in live.intervals.values() if iv.nbytes > 0]
    offsets = _place_groups(planned, reuse_groups(graph, reuse, live))
    arena = max((offsets[iv.value.name] + _aligned(iv.nbytes) for iv in planned), default=0)
    return MemoryPlan(
        offsets=offsets,
        arena_bytes=arena,
        peak_live_bytes=live.peak_bytes,
        param_bytes=_bytes(graph, Role.PARAM),
        trained_param_bytes=_bytes(graph, Role.PARAM, trained_only=True),
        buffer_bytes=_bytes(graph, Role.BUFFER),
        const_bytes=_bytes(graph, Role.CONST),
        state_bytes=_bytes(graph, Role.STATE),
        liveness=live,
    )
