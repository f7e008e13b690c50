"""Update reordering: apply each update as soon as its gradient is complete.

Needs: a verified graph. Guarantees:

- Every effectful node (the EFFECTFUL group: ``sgd_update``, ``sgd_momentum_update``,
  ``adamw_update``, ``assign``) is placed at the earliest point at which its inputs
  are defined and every read of a value it writes, directly or through a value that
  may be a view of it, has happened. So a parameter is updated as soon as its
  gradient is complete, and the gradient (with the optimizer's temporaries) dies at
  once instead of living until the end of the backward pass.
- The optimizer's own pure nodes, those that depend on no batch input and whose
  results only effects (directly or through other such nodes) read, such as AdamW's
  step count ``t = step + 1``, travel with the first effect that needs them: they are
  emitted, in their original order, just before it. Without this an optimizer that
  computes ``t`` after the backward pass would pin every update there.
- Every other node keeps its relative order; verify's effect invariant still holds.

The backward pass runs in reverse layer order, so the last layer's update now runs
before the backward of the earlier layers, and each weight gradient is freed right
after it is used rather than all of them being held until the optimizer runs.

Reads through views count because a backend may implement the ops with ``Fact.VIEW``
(``reshape``, ``transpose``, ``slice``, ``cast`` to the same dtype, ...) as views and the
updates in place: an update of ``w`` waits for the last read of ``transpose(w)`` too.
"""

from __future__ import annotations

import heapq

from pockengine.ir import Fact, Graph, Node, Role, get_op

__all__ = ["reorder_updates"]


def _is_effect(node: Node) -> bool:
    return get_op(node.op).effectful


def _travellers(graph: Graph) -> set[int]:
    """Indices of the pure nodes that depend on no batch input and that only effects
    (directly or through other such nodes) read."""
    batch = {v.name for v in graph.inputs_with_role(Role.INPUT)}
    for node in graph.nodes:
        if any(v.name in batch for v in node.inputs):
            batch.update(v.name for v in node.outputs)
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            readers.setdefault(v.name, []).append(i)
    returned = {v.name for v in graph.outputs}
    found: set[int] = set()
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if _is_effect(node) or any(v.name in returned or v.name in batch for v in node.outputs):
            continue
        reads = [j for v in node.outputs for j in readers.get(v.name, [])]
        if reads and all(_is_effect(graph.nodes[j]) or j in found for j in reads):
            found.add(i)
    return found


def _view_roots(graph: Graph) -> dict[str, str]:
    """For each node result, the graph input or result whose storage it may share."""
    root: dict[str, str] = {}
    for node in graph.nodes:
        for v in node.outputs:
            src = node.inputs[0].name if get_op(node.op).has(Fact.VIEW) else v.name
            root[v.name] = root.get(src, src)
    return root


class _Schedule:
    """Emits nodes in order and releases each effect once its dependencies are emitted."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.travellers = _travellers(graph)
        self.producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
        self.emitted: set[int] = set()
        self.order: list[int] = []
        self.cones: dict[int, list[int]] = {}
        self.missing: dict[int, int] = {}  # effect -> how many of its dependencies are not out
        self.waiting: dict[int, list[int]] = {}  # node -> the effects that wait for it
        self.ready: list[int] = []  # a heap: ready effects leave in their original order
        readers = _readers_by_root(graph)
        for e, node in enumerate(graph.nodes):
            if _is_effect(node):
                self.cones[e] = self._cone(e)
                deps = self._needs(e, readers)
                self.missing[e] = len(deps)
                for d in deps:
                    self.waiting.setdefault(d, []).append(e)
                if not deps:
                    heapq.heappush(self.ready, e)

    def _cone(self, e: int) -> list[int]:
        """The travellers that effect ``e`` needs, in their original order."""
        found: set[int] = set()
        stack = [e]
        while stack:
            for v in self.graph.nodes[stack.pop()].inputs:
                j = self.producer.get(v.name)
                if j is not None and j in self.travellers and j not in found:
                    found.add(j)
                    stack.append(j)
        return sorted(found)

    def _needs(self, e: int, readers: dict[str, list[int]]) -> set[int]:
        """The nodes that must be emitted before effect ``e`` and its cone."""
        members = {e, *self.cones[e]}
        nodes = self.graph.nodes
        deps = {self.producer[v.name] for m in members for v in nodes[m].inputs if v.role is None}
        for j in get_op(nodes[e].op).mutates:
            deps.update(r for r in readers.get(nodes[e].inputs[j].name, []) if r < e)
        return deps - members

    def emit(self, i: int) -> None:
        """Emit node ``i``, then every effect (with its cone) that this makes ready."""
        self._put(i)
        self.flush()

    def flush(self) -> None:
        while self.ready:
            e = heapq.heappop(self.ready)
            for j in (*self.cones[e], e):
                self._put(j)

    def _put(self, i: int) -> None:
        if i in self.emitted:
            return
        self.emitted.add(i)
        self.order.append(i)
        for e in self.waiting.get(i, ()):
            self.missing[e] -= 1
            if self.missing[e] == 0 and e not in self.emitted:
                heapq.heappush(self.ready, e)


def _readers_by_root(graph: Graph) -> dict[str, list[int]]:
    """For each value, the nodes that read it or a value that may be a view of it."""
    root = _view_roots(graph)
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            readers.setdefault(root.get(v.name, v.name), []).append(i)
    return readers


def reorder_updates(graph: Graph) -> Graph:
    """Move each effect to just after the last node it has to follow."""
    if not any(_is_effect(n) for n in graph.nodes):
        return graph
    schedule = _Schedule(graph)
    schedule.flush()  # effects that need nothing computed lead the graph
    for i, node in enumerate(graph.nodes):
        if i not in schedule.travellers and not _is_effect(node):
            schedule.emit(i)
    # A verified graph's own order meets every dependency, so nothing is left here; the
    # fallback keeps the pass from ever dropping a node: the rest follows in order.
    for i in range(len(graph.nodes)):
        if i not in schedule.emitted:
            schedule.emit(i)
    nodes = tuple(graph.nodes[i] for i in schedule.order)
    return graph if nodes == graph.nodes else graph.replace(nodes=nodes)
