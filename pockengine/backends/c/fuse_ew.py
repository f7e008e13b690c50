"""C-backend rewrite: chains of elementwise nodes as one ``elementwise_chain`` each.

A node of ``ops.ew_chain.CHAIN_OPS`` (float math, no attributes) whose result has one
reader, that reader also such a node, and the result the reader's shape (no broadcast
of an intermediate) and dtype, is computed inside its reader: the reader becomes an
``elementwise_chain`` holding both steps, and so on up the chain. SwiGLU's forward
``mul(mul(g, sigmoid(g)), u)`` becomes one pass reading ``g`` and ``u``; its backward's
seven passes over the gate's gradient become two; RMSNorm's scale and weight, LoRA's
scale and add, RoPE's multiply-adds each become one. The memory plan runs on the
rewritten graph, so the intermediates hold no buffer.

Needs: a verified training graph. Guarantees: each chain keeps its last node's result
(name, type, source and phase) and computes the same float operations in the same order
(bit-identical on the C backend, whose compiler does not contract them); a chain reads no
input that a parameter update wrote between its first node and its last; a result the
graph returns or something else reads is never folded away.
"""

from __future__ import annotations

from pockengine.backends.c.views import write_positions
from pockengine.ir import Attrs, CompileError, Graph, Node, Value, get_op
from pockengine.ops.ew_chain import CHAIN_OPS

__all__ = ["fuse_elementwise_chains"]

_MAX_INPUTS = 8  # a chain's distinct inputs: the loop's pointers stay in registers
_MAX_STEPS = 24


def _eligible(node: Node) -> bool:
    if CHAIN_OPS.get(node.op) != len(node.inputs) or node.attrs or len(node.outputs) != 1:
        return False
    out = node.outputs[0]
    return out.dtype.is_float and all(v.dtype is out.dtype for v in node.inputs)


def _roots(graph: Graph) -> dict[int, int]:
    """Each eligible node's position -> the position of the node whose chain computes it
    (itself where it stays a node). Walked from the last node: a result joins its readers'
    chain when they all belong to one chain, it has their shape, and nothing writes its
    inputs between it and that chain's last node."""
    users, returned, writes = graph.users(), {v.name for v in graph.outputs}, write_positions(graph)
    at = {id(node): k for k, node in enumerate(graph.nodes)}
    root: dict[int, int] = {}
    size: dict[int, int] = {}  # a chain's steps so far
    reads: dict[int, set[str]] = {}  # the values a chain's nodes read or make
    for k in reversed(range(len(graph.nodes))):
        node = graph.nodes[k]
        if not _eligible(node):
            continue
        out = node.outputs[0]
        readers = {root.get(at[id(u)], -1) for u in users.get(out.name, [])}
        r = readers.pop() if len(readers) == 1 and out.name not in returned else -1
        names = {v.name for v in node.inputs}
        if r >= 0 and _joins(graph, k, r, names, writes, size[r], reads[r]):
            root[k], size[r] = r, size[r] + 1
            reads[r] |= names
        else:
            root[k], size[k], reads[k] = k, 1, {*names, out.name}
    return root


def _joins(
    graph: Graph,
    k: int,
    r: int,
    names: set[str],
    writes: dict[str, list[int]],
    size: int,
    reads: set[str],
) -> bool:
    """Whether node ``k`` may be computed inside the chain ending at node ``r``."""
    if graph.nodes[k].outputs[0].type != graph.nodes[r].outputs[0].type or size >= _MAX_STEPS:
        return False
    if any(k < w < r for name in names for w in writes.get(name, ())):
        return False
    return len(reads | names) <= _MAX_INPUTS + size + 1


def _fused(nodes: list[Node]) -> Node:
    """The chain of ``nodes`` (in graph order; the last one's result is the chain's)."""
    made = {n.outputs[0].name: k for k, n in enumerate(nodes)}
    inputs: dict[str, Value] = {}
    for n in nodes:
        for v in n.inputs:
            if v.name not in made:
                inputs.setdefault(v.name, v)
    index = {name: j for j, name in enumerate(inputs)}
    index.update({name: len(inputs) + k for name, k in made.items()})
    ops = tuple(n.op for n in nodes)
    args = tuple(tuple(index[v.name] for v in n.inputs) for n in nodes)
    last = nodes[-1]
    attrs = Attrs(ops=ops, args=args)
    fused = last.replace(op="elementwise_chain", inputs=tuple(inputs.values()), attrs=attrs)
    types = get_op(fused.op).infer_types([v.type for v in fused.inputs], fused.attrs)
    if types != (last.outputs[0].type,):
        raise CompileError(f"fuse_ew: a chain would change {last.outputs[0]}")
    return fused


def fuse_elementwise_chains(graph: Graph) -> Graph:
    """``graph`` with its chains of elementwise nodes fused (the module docstring);
    ``graph`` itself when it has none."""
    root = _roots(graph)
    members: dict[int, list[Node]] = {}
    for k, r in sorted(root.items()):
        members.setdefault(r, []).append(graph.nodes[k])
    if all(len(m) == 1 for m in members.values()):
        return graph
    nodes = []
    for k, node in enumerate(graph.nodes):
        if k not in root:
            nodes.append(node)
        elif root[k] == k:
            nodes.append(_fused(members[k]) if len(members[k]) > 1 else node)
    return graph.replace(nodes=tuple(nodes))
