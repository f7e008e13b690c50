"""Liveness: when each non-persistent value is alive, and how many bytes are live when.

Persistent values (params, buffers, consts and optimizer state) live for the whole
training run and are not tracked here. Every other value, a node result or a batch
input, lives from the node that defines it (index -1 for a graph input) through the
last node that reads it; a graph output lives to the end, index ``len(nodes)``; a
result that nothing reads lives only at its own node. Intervals are inclusive: a
node's results and its inputs are live together, except where ``reuse`` says a node
writes its result over an input that dies there (``plan.inplace``): that input's
lifetime then ends just before the node.

``last_reads`` is the one last-use analysis of the engine: the memory plan, in-place
reuse, rematerialisation and the backends (the torch codegen's ``del``s, the NumPy
interpreter's drops) all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate

from pockengine.ir import Graph, Role, Value

__all__ = ["PERSISTENT_ROLES", "Interval", "Liveness", "last_reads", "liveness"]

PERSISTENT_ROLES = frozenset({Role.PARAM, Role.BUFFER, Role.CONST, Role.STATE})


@dataclass(frozen=True, slots=True)
class Interval:
    """A value's lifetime: node indices ``start`` through ``end``, both included."""

    value: Value
    start: int  # the defining node; -1 for a graph input
    end: int  # the last reading node; len(nodes) for a graph output

    @property
    def nbytes(self) -> int:
        return self.value.type.nbytes

    def overlaps(self, other: Interval) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class Liveness:
    """The lifetimes of a graph's non-persistent values, in definition order."""

    num_nodes: int
    intervals: dict[str, Interval]

    def live_at(self, index: int) -> list[Value]:
        """The values live at node ``index`` (-1 is the entry, num_nodes the exit)."""
        return [iv.value for iv in self.intervals.values() if iv.start <= index <= iv.end]

    def _timeline(self) -> list[int]:
        """Live bytes at each time point -1 .. num_nodes (list index = time + 1)."""
        delta = [0] * (self.num_nodes + 3)
        for iv in self.intervals.values():
            delta[iv.start + 1] += iv.nbytes
            delta[iv.end + 2] -= iv.nbytes
        return list(accumulate(delta))[: self.num_nodes + 2]

    def live_bytes(self) -> list[int]:
        """The bytes of the values live at each node, one entry per node."""
        return self._timeline()[1:-1]

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at once, entry and exit included."""
        return max(self._timeline())

    @property
    def peak_index(self) -> int:
        """A node index (-1 or num_nodes for entry or exit) at which the peak is reached."""
        timeline = self._timeline()
        return timeline.index(max(timeline)) - 1


def last_reads(graph: Graph) -> dict[str, int]:
    """The index of the last node reading each value of ``graph``, persistent ones too: a
    graph output's is ``len(nodes)``, a result nothing reads dies at its own node, a graph
    input nothing reads at -1."""
    last = {v.name: -1 for v in graph.inputs}
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            last[v.name] = i
        for v in node.inputs:
            last[v.name] = i
    for v in graph.outputs:
        last[v.name] = len(graph.nodes)
    return last


def liveness(graph: Graph, reuse: Mapping[int, int] | None = None) -> Liveness:
    """The lifetime of every node result and batch input of ``graph``; ``reuse`` maps a node
    index to the position of the input whose buffer its result takes."""
    end = len(graph.nodes)
    starts: dict[str, tuple[Value, int]] = {}
    for v in graph.inputs:
        if v.role not in PERSISTENT_ROLES:
            starts[v.name] = (v, -1)
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            starts[v.name] = (v, i)
    last = last_reads(graph)
    for i, k in (reuse or {}).items():
        name = graph.nodes[i].inputs[k].name
        if last.get(name) == i and starts[name][1] < i:
            last[name] = i - 1
    intervals = {name: Interval(v, start, last[name]) for name, (v, start) in starts.items()}
    return Liveness(end, intervals)
