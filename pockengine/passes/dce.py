"""Dead-code elimination.

Needs: a verified graph. Guarantees: every remaining node is effectful or has a
result that a graph output or a remaining node reads; inputs are unchanged.
"""

from __future__ import annotations

from pockengine.ir import Graph, get_op

__all__ = ["eliminate_dead_code"]


def eliminate_dead_code(graph: Graph) -> Graph:
    live = {v.name for v in graph.outputs}
    kept = []
    for node in reversed(graph.nodes):
        if get_op(node.op).effectful or any(v.name in live for v in node.outputs):
            kept.append(node)
            live.update(v.name for v in node.inputs)
    if len(kept) == len(graph.nodes):
        return graph
    return graph.replace(nodes=tuple(reversed(kept)))
