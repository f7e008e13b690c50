"""Links between nodes that the torch backend's source generation honours (``codegen``).

- pairs: an earlier node's kernel hands a by-product to a later one through a hidden
  local (max pooling indices, batch norm's 1/std; ``PairFinder``);
- absorption: a node's kernel computes the results of some later nodes (batch norm its
  running statistics, the first of a run of gated assigns the whole run; ``Absorber``),
  and those nodes' own lines emit nothing. The results the kernel binds keep their
  locals; the others are never made, so every reader of one must be absorbed too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pockengine.ir import Graph, Node, Value

__all__ = [
    "Absorbed",
    "Absorber",
    "GraphIndex",
    "PairFinder",
    "Pairs",
    "absorptions",
    "find_pairs",
]


@dataclass(frozen=True, slots=True)
class GraphIndex:
    """Lookups a pair finder needs: the node making each value, the nodes reading it, and
    where each value is made (the index of its node; -1 for a graph input), and each node's
    index (keyed by ``id(node)``)."""

    producers: Mapping[str, Node]
    users: Mapping[str, list[Node]]
    made_at: Mapping[str, int]
    position: Mapping[int, int]

    def at(self, node: Node) -> int:
        """The index of ``node`` in the graph."""
        return self.position[id(node)]


# For a node of its op, the earlier node ("maker") whose kernel also computes a hidden value
# this node's kernel reads (argmax indices for max_pool2d_grad, ...), or None.
PairFinder = Callable[[Node, GraphIndex], Node | None]


@dataclass(frozen=True, slots=True)
class Absorbed:
    """The later nodes (by index) whose results a node's kernel computes, the results of
    theirs it binds (to the locals they would have had), the values it reads beyond its
    node's inputs, and what the absorber found out (``attrs``, for the kernel)."""

    nodes: tuple[int, ...]
    binds: tuple[Value, ...] = ()
    reads: tuple[Value, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)


# For node ``i`` of its op, the later nodes its kernel computes too, or None; the set holds
# the nodes absorbed already (by an earlier node), which no other node may absorb.
Absorber = Callable[[int, Graph, GraphIndex, frozenset[int]], Absorbed | None]


def _sound(absorbed: Absorbed, i: int, graph: Graph, index: GraphIndex) -> bool:
    """Later nodes only; each result left unmade is read by absorbed nodes alone."""
    if not absorbed.nodes or min(absorbed.nodes) <= i:
        return False
    inside = set(absorbed.nodes)
    bound = {v.name for v in absorbed.binds}
    returned = {v.name for v in graph.outputs}
    for j in absorbed.nodes:
        for v in graph.nodes[j].outputs:
            if v.name in bound:
                continue
            readers = index.users.get(v.name, [])
            if v.name in returned or any(index.at(r) not in inside for r in readers):
                return False
    return True


def absorptions(
    graph: Graph, index: GraphIndex, absorbers: Mapping[str, Absorber]
) -> dict[int, Absorbed]:
    """Node index -> what its kernel absorbs, for the nodes whose absorber found something
    sound; a node absorbed by an earlier one absorbs nothing itself."""
    found: dict[int, Absorbed] = {}
    taken: set[int] = set()
    for i, node in enumerate(graph.nodes):
        absorber = absorbers.get(node.op)
        if absorber is None or i in taken:
            continue
        absorbed = absorber(i, graph, index, frozenset(taken))
        if absorbed is None or taken & set(absorbed.nodes):
            continue
        if _sound(absorbed, i, graph, index):
            found[i] = absorbed
            taken.update(absorbed.nodes)
    return found


@dataclass
class Pairs:
    """Hidden locals shared by paired nodes (see ``PairFinder``)."""

    hidden: dict[int, str] = field(default_factory=dict)  # node index -> its hidden local
    partner: dict[int, Node] = field(default_factory=dict)  # maker -> first reader, and back
    last: dict[str, int] = field(default_factory=dict)  # hidden local -> its last reader


def find_pairs(graph: Graph, index: GraphIndex, finders: Mapping[str, PairFinder]) -> Pairs:
    pairs = Pairs()
    for i, node in enumerate(graph.nodes):
        finder = finders.get(node.op)
        maker = finder(node, index) if finder else None
        if maker is None or index.at(maker) >= i:
            continue
        j = index.at(maker)
        name = pairs.hidden.setdefault(j, f"h{j}")
        pairs.hidden[i] = name
        pairs.partner.setdefault(j, node)
        pairs.partner[i] = maker
        pairs.last[name] = i
    return pairs
