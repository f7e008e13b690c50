"""Merge repeated recomputations: a recomputed value is not made again while a copy lives.

Two recomputations can repeat the same forward node on the same operands: a memory
budget (``passes.remat_budget``) recomputes a layer's projections in its backward, and
the cheap rule of ``passes.remat`` recomputed some of the same values (a normalisation's
output, grouped-query attention's keys and values expanded to every head) for readers
of its own. ``merge_recomputations`` points the readers of a later copy at an earlier
one, as common-subexpression elimination would, but only between recomputed copies (a
copy merged into the forward value it recomputes would undo the recomputation), and only
while the earlier copy is still alive where the later one is made: the merged value then
lives no longer than the two did, and no byte is added to any point of the plan.

Needs: a verified graph; recomputed values are the results of backward nodes named
``<original>_re<k>`` (``passes.remat.recompute``). Guarantees: the same values, bit for
bit; no recomputed backward node repeats one whose results are alive where it is made;
live bytes at every node at most those before; every other node is unchanged and stays
in order.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

from pockengine.ir import Graph, Node, Phase, Value, get_op
from pockengine.ir.rewrite import substitute
from pockengine.passes.cse import node_key
from pockengine.plan.liveness import last_reads

__all__ = ["merge_recomputations"]

_RECOMPUTED = re.compile(r"_re[0-9]+$")


def _key(node: Node) -> Hashable | None:
    """What makes two recomputations interchangeable, or None for a node never merged."""
    opdef = get_op(node.op)
    if node.phase is not Phase.BACKWARD or not node.outputs or opdef.effectful:
        return None
    if not all(_RECOMPUTED.search(v.name) for v in node.outputs):
        return None
    return node_key(node)


def merge_recomputations(graph: Graph) -> Graph:
    """Point the readers of a repeated recomputation at its live first copy (the module
    doc)."""
    last = last_reads(graph)  # of the merged values too, as merges extend them
    first: dict[Hashable, Node] = {}
    mapping: dict[str, Value] = {}
    kept: list[Node] = []
    for i, node in enumerate(graph.nodes):
        (node,) = substitute((node,), mapping)
        key = _key(node)
        earlier = first.get(key) if key is not None else None
        pairs = list(zip(node.outputs, earlier.outputs, strict=True)) if earlier else []
        # an unread result needs no live counterpart
        if earlier and all(last[new.name] <= i or last[old.name] >= i for new, old in pairs):
            for new, old in pairs:
                mapping[new.name] = old
                last[old.name] = max(last[old.name], last[new.name])
            continue
        if key is not None:
            first[key] = node
        kept.append(node)
    if not mapping:
        return graph
    outputs = tuple(mapping.get(v.name, v) for v in graph.outputs)
    return graph.replace(nodes=tuple(kept), outputs=outputs)
