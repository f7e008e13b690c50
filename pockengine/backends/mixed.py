"""Several backends for one step: each node runs on the first backend in a list that claims it.

``MixedBackend(["onnxruntime", "numpy"])`` (or ``pe.compile(..., backend=[...])``) asks each
backend, in order, whether it ``claims`` a node; the first that does runs it, and a node
nobody claims is one ``UnsupportedOpError`` naming every such op and its source.
``plan.placement`` groups consecutive nodes of one backend into segments; each segment is
compiled by its backend as a graph of its own (its inputs: the graph inputs it reads and
the results of earlier segments; its outputs: what later segments or the step return).

Values cross backends in one place, ``hand_over`` (the source backend's ``to_numpy``, the
destination's ``from_numpy``). The state lives in the step's one ``Store``; each stored
value is held in the format of the backend whose segment writes it (converted on the first
step, then left there), and by the primary backend (the first in the list) when nothing
writes it. A reader on another backend gets a converted copy: every step for a value that
some segment writes, once (cached) for one that nothing writes, such as a frozen weight.
The batch is converted by the primary backend, as with a single backend.

When the whole graph lands on the primary backend, ``compile`` returns that backend's own
executable: a single-backend step runs exactly as without the list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.backends.base import Backend, Executable, Store
from pockengine.ir import Graph, Node, Role, UnsupportedOpError, Value, get_op
from pockengine.ir.arrays import Array
from pockengine.plan.liveness import last_reads
from pockengine.plan.placement import PRIMARY, Placement, place

__all__ = ["MixedBackend", "MixedExecutable", "hand_over"]


def hand_over(value: Any, backends: Sequence[Backend], dst: Backend) -> Any:
    """``value`` as a tensor of ``dst``: itself when ``dst`` holds it already, else a copy
    through NumPy from whichever backend holds it (a NumPy array is taken as it is)."""
    if dst.holds(value):
        return value
    for src in backends:
        if src.holds(value):
            return dst.from_numpy(src.to_numpy(value))
    return dst.from_numpy(np.asarray(value))


@dataclass(frozen=True)
class _Part:
    """One segment, compiled: what it reads from the feeds and store, writes and returns."""

    backend: Backend
    executable: Executable
    fed: tuple[str, ...]  # batch inputs and earlier segments' results
    stored: tuple[str, ...]  # params, buffers and state it reads or writes
    written: tuple[str, ...]  # the stored values its effects write
    outputs: tuple[str, ...]
    drops: tuple[str, ...]  # crossing values no later segment reads


class MixedExecutable(Executable):
    """A graph run as segments on several backends; see the module doc."""

    def __init__(self, graph: Graph, owner: MixedBackend, placement: Placement) -> None:
        self.graph = graph
        self.placement = placement
        self._backends = owner.backends
        last = last_reads(graph)
        self._parts = tuple(self._part(graph, k, last) for k in range(len(placement.segments)))
        written = {n for p in self._parts for n in p.written}
        # stored values nothing writes, converted once per reader: name, backend -> (src, copy)
        self._unwritten = {v.name for v in graph.inputs if v.role is not Role.INPUT} - written
        self._cache: dict[tuple[str, int], tuple[Any, Any]] = {}

    def _part(self, graph: Graph, k: int, last: Mapping[str, int]) -> _Part:
        """Segment ``k`` as a graph of its own, compiled by its backend."""
        seg = self.placement.segments[k]
        nodes = graph.nodes[seg.start : seg.stop]
        made = {v.name for n in nodes for v in n.outputs}
        inputs: dict[str, Value] = {}
        for node in nodes:
            for v in node.inputs:
                if v.name not in made and v.name not in inputs:
                    inputs[v.name] = v if v.role is not None else v.replace(role=Role.INPUT)
        # read after this segment or returned (last_reads puts graph outputs at the end)
        outs = tuple(v for n in nodes for v in n.outputs if last[v.name] >= seg.stop)
        sub = Graph(f"{graph.name}.{k}", tuple(inputs.values()), tuple(nodes), outs)
        backend = self._backends[seg.backend]
        fed = tuple(n for n, v in inputs.items() if v.role is Role.INPUT)
        return _Part(
            backend,
            backend.compile(sub),
            fed,
            tuple(n for n, v in inputs.items() if v.role is not Role.INPUT),
            tuple(sorted(_written(sub))),
            tuple(v.name for v in outs),
            tuple(n for n in fed if last[n] < seg.stop),
        )

    def _stored(self, store: Store, name: str, k: int, backend: Backend) -> Any:
        value = store[name]
        if name not in self._unwritten or backend.holds(value):
            return hand_over(value, self._backends, backend)
        hit = self._cache.get((name, k))
        if hit is None or hit[0] is not value:  # replaced (load_state) since: convert again
            hit = (value, hand_over(value, self._backends, backend))
            self._cache[(name, k)] = hit
        return hit[1]

    def run(self, store: Store, feeds: Mapping[str, Any]) -> list[Any]:
        """Run the segments in order on ``store`` (written values move to their writer's
        format) and ``feeds``; results come back in the format of the backend making them."""
        values: dict[str, Any] = dict(feeds)
        for part, seg in zip(self._parts, self.placement.segments, strict=True):
            b = part.backend
            local_feeds = {n: hand_over(values[n], self._backends, b) for n in part.fed}
            local = {n: self._stored(store, n, seg.backend, b) for n in part.stored}
            outs = part.executable.run(local, local_feeds)
            for name in part.written:
                store[name] = local[name]
            values.update(zip(part.outputs, outs, strict=True))
            for name in part.drops:
                values.pop(name, None)
        return [values[v.name] if v.name in values else store[v.name] for v in self.graph.outputs]


def _written(graph: Graph) -> set[str]:
    return {n.inputs[j].name for n in graph.nodes for j in get_op(n.op).mutates}


class MixedBackend(Backend):
    """A priority list of backends; each node goes to the first that claims it."""

    name = "mixed"

    def __init__(self, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ValueError("a backend list needs at least one backend")
        self.backends = tuple(backends)
        self.name = "+".join(b.name for b in self.backends)

    @property
    def primary(self) -> Backend:
        return self.backends[PRIMARY]

    def assign(self, graph: Graph) -> tuple[int, ...]:
        """The backend (index) of each node: the first claiming it."""
        chosen: list[int] = []
        missing: dict[tuple[str, str], None] = {}
        for node in graph.nodes:
            k = next((k for k, b in enumerate(self.backends) if b.claims(node)), -1)
            if k < 0:
                missing[(node.op, node.source)] = None
            chosen.append(k)
        if missing:
            names = ", ".join(b.name for b in self.backends)
            raise UnsupportedOpError(f"ops for any of the backends {names}", list(missing))
        return tuple(chosen)

    def placement(self, graph: Graph) -> Placement:
        """Which backend runs each node, the segments and the boundary transfers."""
        names = [b.name for b in self.backends]
        names = [n if names.count(n) == 1 else f"{n}#{k}" for k, n in enumerate(names)]
        return place(graph, self.assign(graph), names)

    def compile(self, graph: Graph) -> Executable:
        placement = self.placement(graph)
        if all(k == PRIMARY for k in placement.assignment):
            return self.primary.compile(graph)  # one segment: the primary's own path
        return MixedExecutable(graph, self, placement)

    def supported_ops(self) -> frozenset[str]:
        return frozenset().union(*(b.supported_ops() for b in self.backends))

    def claims(self, node: Node) -> bool:
        return any(b.claims(node) for b in self.backends)

    def holds(self, value: Any) -> bool:
        return any(b.holds(value) for b in self.backends)

    def from_numpy(self, array: Array) -> Any:
        return self.primary.from_numpy(array)

    def to_numpy(self, tensor: Any) -> Array:
        for b in self.backends:
            if b.holds(tensor):
                return b.to_numpy(tensor)
        return np.asarray(tensor)
