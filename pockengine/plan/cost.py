"""The cost model: FLOPs and bytes moved by every node, from each op's ``flops`` rule.

Bytes read are the sizes of a node's inputs and bytes written the sizes of its
results (for an effect, of the values it writes), counted once per node as if every
operand went through memory: an upper bound that ignores caches and fusion. Each node
also gets a phase: ``update`` for effects (forward ones too: batch norm's running
statistics), otherwise the node's own ``Phase`` (autodiff marks the backward, the
optimizer its updates).
"""

from __future__ import annotations

from dataclasses import dataclass

from pockengine.ir import Graph, Node, Phase, get_op

__all__ = ["PHASES", "Cost", "NodeCost", "cost"]

PHASES = tuple(Phase)


@dataclass(frozen=True, slots=True)
class NodeCost:
    index: int
    op: str
    phase: Phase
    flops: int
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class Cost:
    """Per-node costs of a graph, in graph order, with totals."""

    nodes: tuple[NodeCost, ...]

    @property
    def flops(self) -> int:
        return sum(c.flops for c in self.nodes)

    @property
    def bytes_read(self) -> int:
        return sum(c.bytes_read for c in self.nodes)

    @property
    def bytes_written(self) -> int:
        return sum(c.bytes_written for c in self.nodes)

    def flops_by_phase(self) -> dict[str, int]:
        totals = {str(p): 0 for p in PHASES}
        for c in self.nodes:
            totals[c.phase] += c.flops
        return totals


def _phase(node: Node) -> Phase:
    return Phase.UPDATE if get_op(node.op).effectful else node.phase


def _node_cost(index: int, node: Node) -> NodeCost:
    opdef = get_op(node.op)
    ins = tuple(v.type for v in node.inputs)
    outs = tuple(v.type for v in node.outputs)
    written = tuple(ins[i] for i in opdef.mutates) if opdef.effectful else outs
    return NodeCost(
        index=index,
        op=node.op,
        phase=_phase(node),
        flops=int(opdef.flops(ins, outs, node.attrs)),
        bytes_read=sum(t.nbytes for t in ins),
        bytes_written=sum(t.nbytes for t in written),
    )


def cost(graph: Graph) -> Cost:
    """The FLOPs and bytes of every node of ``graph``."""
    return Cost(tuple(_node_cost(i, node) for i, node in enumerate(graph.nodes)))
