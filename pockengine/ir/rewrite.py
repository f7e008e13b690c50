"""Small rewriting helpers shared by graph transformations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pockengine.ir.types import Graph, Node, Value

__all__ = ["substitute", "with_inputs"]


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
