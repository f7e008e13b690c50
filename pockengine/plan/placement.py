"""Placement: which backend runs each node, the segments that makes, and what crosses them.

Given one backend index per node (``assignment``; ``backends.mixed`` decides it: the first
backend in the user's list that claims the node, or the fastest one), consecutive nodes of
one backend form a segment, compiled and run by that backend as one graph. A value read by
a segment but held by another backend is handed over at the segment's start:

- a node result, in the format of the backend that made it;
- a batch input, in the format of the primary backend (the first in the list: the step
  converts the batch with it);
- a stored value (param, buffer, optimizer state), in the format of the backend whose
  segment writes it (its owner; after the first step it stays there), or of the primary
  backend when nothing writes it. Such a value that nothing writes is converted once and
  cached by the reader (``Transfer.cached``); the others cross every step.

This is a pure analysis of the graph: ``backends.mixed`` runs it, ``plan.report`` shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pockengine.ir import Graph, Role, Value, get_op

__all__ = ["PRIMARY", "Placement", "Segment", "Transfer", "place"]

PRIMARY = 0  # the backend that holds batch inputs and unwritten stored values


@dataclass(frozen=True, slots=True)
class Segment:
    """Nodes ``start`` up to (not including) ``stop``, run by backend ``backend``."""

    backend: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """``value`` handed from backend ``src`` to backend ``dst`` before segment ``segment``."""

    value: Value
    src: int
    dst: int
    segment: int
    cached: bool  # a stored value nothing writes: converted once, not every step


@dataclass(frozen=True)
class Placement:
    """The backend of every node, the segments and the boundary transfers of a graph."""

    backends: tuple[str, ...]  # names, the primary first
    assignment: tuple[int, ...]  # the backend of each node
    ops: tuple[str, ...]  # the op of each node
    segments: tuple[Segment, ...]
    transfers: tuple[Transfer, ...]

    def nodes_per_backend(self) -> dict[str, int]:
        counts = dict.fromkeys(self.backends, 0)
        for k in self.assignment:
            counts[self.backends[k]] += 1
        return counts

    def per_step(self) -> tuple[Transfer, ...]:
        """The transfers every step pays (cached ones excluded)."""
        return tuple(t for t in self.transfers if not t.cached)

    @property
    def transfer_bytes(self) -> int:
        """Bytes handed over every step."""
        return sum(t.value.type.nbytes for t in self.per_step())

    def summary(self) -> str:
        counts = ", ".join(f"{name} {n}" for name, n in self.nodes_per_backend().items())
        steps = self.per_step()
        return (
            f"nodes per backend: {counts}; {len(self.segments)} segments; "
            f"{len(steps)} transfers a step ({self.transfer_bytes / 2**20:.2f} MiB), "
            f"{len(self.transfers) - len(steps)} cached"
        )


def segments_of(assignment: Sequence[int]) -> tuple[Segment, ...]:
    """Maximal runs of consecutive nodes on one backend."""
    out: list[Segment] = []
    start = 0
    for i in range(1, len(assignment) + 1):
        if i == len(assignment) or assignment[i] != assignment[start]:
            out.append(Segment(assignment[start], start, i))
            start = i
    return tuple(out)


def _owners(graph: Graph, assignment: Sequence[int]) -> dict[str, int]:
    """The backend whose format each value is in when a segment reads it."""
    owner = {v.name: PRIMARY for v in graph.inputs}
    for i, node in enumerate(graph.nodes):
        for j in get_op(node.op).mutates:
            owner[node.inputs[j].name] = assignment[i]
        for v in node.outputs:
            owner[v.name] = assignment[i]
    return owner


def place(graph: Graph, assignment: Sequence[int], backends: Sequence[str]) -> Placement:
    """The placement of ``graph`` with node ``i`` on backend ``assignment[i]``."""
    if len(assignment) != len(graph.nodes):
        raise ValueError(f"{len(assignment)} backends for {len(graph.nodes)} nodes")
    segments = segments_of(assignment)
    owner = _owners(graph, assignment)
    written = {n.inputs[j].name for n in graph.nodes for j in get_op(n.op).mutates}
    stored = {v.name for v in graph.inputs if v.role is not Role.INPUT}
    transfers: list[Transfer] = []
    for k, seg in enumerate(segments):
        made = {v.name for n in graph.nodes[seg.start : seg.stop] for v in n.outputs}
        seen: set[str] = set()
        for node in graph.nodes[seg.start : seg.stop]:
            for v in node.inputs:
                if v.name in made or v.name in seen or owner[v.name] == seg.backend:
                    continue
                seen.add(v.name)
                cached = v.name in stored and v.name not in written
                transfers.append(Transfer(v, owner[v.name], seg.backend, k, cached))
    ops = tuple(n.op for n in graph.nodes)
    return Placement(tuple(backends), tuple(assignment), ops, segments, tuple(transfers))
