"""Small rewriting helpers shared by graph transformations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pockengine.ir.types import Graph, Node, Value

__all__ = ["FreshNames", "substitute", "with_inputs"]


def substitute(nodes: Iterable[Node], mapping: Mapping[str, Value]) -> list[Node]:
    """The nodes with every read of a value named in ``mapping`` replaced by its new value."""
    out = []
    for node in nodes:
        if any(v.name in mapping for v in node.inputs):
            node = node.replace(inputs=tuple(mapping.get(v.name, v) for v in node.inputs))
        out.append(node)
    return out


def with_inputs(graph: Graph, inputs: Iterable[Value]) -> Graph:
    """The graph with some inputs replaced by same-named values (a role or flag change)."""
    mapping = {v.name: v for v in inputs}
    new_inputs = tuple(mapping.get(v.name, v) for v in graph.inputs)
    return Graph(
        graph.name,
        new_inputs,
        tuple(substitute(graph.nodes, mapping)),
        tuple(mapping.get(v.name, v) for v in graph.outputs),
    )


class FreshNames:
    """Value names not yet in a graph: ``fresh("x_t")`` is the first of ``x_t0``, ``x_t1``,
    ... that neither the graph nor an earlier ``fresh`` holds."""

    def __init__(self, graph: Graph) -> None:
        self.taken = {v.name for v in graph.inputs}
        self.taken.update(v.name for n in graph.nodes for v in n.outputs)

    def fresh(self, stem: str) -> str:
        k = 0
        while f"{stem}{k}" in self.taken:
            k += 1
        self.taken.add(f"{stem}{k}")
        return f"{stem}{k}"
