"""Which saved values a checkpointed block keeps: a cost model of FLOPs per byte.

Checkpointing a transformer layer recomputes every value its backward reads from the
layer's input; most of them are projections of a 576-wide input (SmolLM2: q, k, v, the
attention's output projection, gate and up), which cost the same FLOPs per byte to make
again (2 * 576 multiply-adds per 4-byte element), while others cost far less per byte:
a normalisation's statistics and output, the rotary embedding, the attention's output
and log-sum-exp (its FLOPs grow with the sequence, not the width). A memory budget that
leaves room for some saved values is spent best on those that save the most FLOPs per
byte kept ("selective activation recomputation", Korthikanti et al. 2022; Checkmate,
Jain et al. 2020, solves the same choice exactly).

``SavedValues.of(graph)`` lists the saved forward values and what recomputing each
repeats. ``keep_order(saved, blocks)`` ranks the targets of checkpointed blocks to keep
instead. Blocks come last block first: the backward meets it first, so its kept values
are freed before any other block's recomputed copies are made, and a block kept whole
adds no recomputed copies to the working set at the start of the backward, the step's
peak (keeping the same bytes spread over many blocks, each of them recomputed, plans
higher). Within a block, greedily, the group of values (the results of one node: the
attention's output and its log-sum-exp are made together) whose keeping removes the most
recomputed FLOPs per byte, given the groups kept before it; a group whose keeping saves
nothing (its recomputation is needed anyway) is not ranked. ``FitMemoryBudget`` keeps
the longest prefix of that order that meets its budget, so the block it cuts into keeps
its most expensive values and recomputes the cheap ones.

Needs: a training graph whose backward nodes have ``Phase.BACKWARD``. Guarantees:
nothing about the graph; the order is a function of the graph alone (deterministic).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pockengine.ir import Fact, Graph, Node, Phase, Value, get_op
from pockengine.plan.cost import cost

__all__ = ["SavedValues", "keep_order"]


@dataclass(frozen=True)
class SavedValues:
    """The saved forward values of a graph and what recomputing each would repeat."""

    producers: dict[str, Node]
    flops: dict[str, int]  # value -> FLOPs of its producer
    saved: dict[str, Value]  # read by the backward, made by a pure forward node
    alive: frozenset[str]  # read by the backward at all (saved, params, batch inputs)

    @classmethod
    def of(cls, graph: Graph) -> SavedValues:
        producers, flops = graph.producers(), {}
        for node, c in zip(graph.nodes, cost(graph).nodes, strict=True):
            flops.update(dict.fromkeys((v.name for v in node.outputs), c.flops))
        returned = {v.name for v in graph.outputs}
        read = {v.name: v for n in graph.nodes if n.phase is Phase.BACKWARD for v in n.inputs}
        saved = {
            name: v
            for name, v in read.items()
            if name in producers
            and producers[name].phase is not Phase.BACKWARD
            and not get_op(producers[name].op).effectful
            and name not in returned
            and v.type.nbytes > 0
        }
        return cls(producers, flops, saved, frozenset(read))

    def estimate(self, name: str, dropped: Collection[str]) -> int:
        """FLOPs of recomputing ``name`` while the ``dropped`` values are not kept."""
        return self.estimate_all((name,), dropped)

    def estimate_all(self, names: Collection[str], dropped: Collection[str]) -> int:
        """FLOPs of recomputing every value of ``names`` while the ``dropped`` values are
        not kept, each repeated node counted once."""
        total, seen, stack = 0, set[int](), list(names)
        while stack:
            node = self.producers.get(stack.pop())
            if node is None or id(node) in seen or get_op(node.op).has(Fact.CONSTANT):
                continue
            seen.add(id(node))
            total += self.flops[node.outputs[0].name]
            stack.extend(
                u.name for u in node.inputs if u.name in dropped or u.name not in self.alive
            )
        return total


def _groups(saved: SavedValues, targets: Collection[str]) -> list[tuple[str, ...]]:
    """The targets grouped by the node that makes them, in the order they are made."""
    groups: dict[int, list[str]] = {}
    for name in targets:
        groups.setdefault(id(saved.producers[name]), []).append(name)
    order = {name: k for k, name in enumerate(saved.saved)}
    return sorted((tuple(sorted(g, key=order.__getitem__)) for g in groups.values()),
                  key=lambda g: order[g[0]])  # fmt: skip


_Ranked = list[tuple[float, tuple[str, ...]]]  # (FLOPs saved per byte kept, group)


def _block_sequence(saved: SavedValues, targets: Collection[str]) -> _Ranked:
    """One block's groups in greedy order, each with the FLOPs per byte its keeping saves."""
    left = set(targets)
    groups = _groups(saved, targets)
    out: _Ranked = []
    while groups:
        now = saved.estimate_all(left, left)
        best, best_ratio = None, 0.0
        for group in groups:
            rest = left.difference(group)
            ratio = (now - saved.estimate_all(rest, rest)) / sum(
                saved.saved[n].type.nbytes for n in group
            )
            if ratio > best_ratio:
                best, best_ratio = group, ratio
        if best is None:  # keeping any of the rest saves nothing
            break
        groups.remove(best)
        left.difference_update(best)
        out.append((best_ratio, best))
    return out


def keep_order(saved: SavedValues, blocks: Sequence[Collection[str]]) -> list[tuple[str, ...]]:
    """The groups of the blocks' targets to keep: the last block's first, each block's in
    greedy order (the module doc)."""
    return [group for targets in reversed(blocks) for _, group in _block_sequence(saved, targets)]
