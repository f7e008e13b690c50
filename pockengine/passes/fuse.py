"""Fusion of patterns into fewer, larger kernels.

``fold_channel_affine``: a convolution whose output is only scaled and shifted per output
channel, ``conv2d(x, w, b) * s + h`` with ``s`` and ``h`` of shape [C, 1, 1] (an eval-mode
BatchNorm, as the frontends lower a frozen one), becomes ``conv2d(x, w * s, b * s + h)``.
The scaled weight costs one pass over the weight per step instead of two over the
activation, and the backward needs no per-channel multiply either: autodiff, which runs
after this pass, differentiates the folded form (into ``w`` and ``h`` where they train).
A scale computed from a trained param (a BatchNorm on running statistics whose scale
trains, ``batchnorm="running"``) is not folded: its gradient through ``w * s`` would
need the convolution's whole weight gradient (its FLOPs, and its input kept for it),
where unfolded it is a per-channel sum over the convolution's output.

``fuse_linear_bias``: ``add(matmul(x, w), b)`` with ``w`` a matrix and ``b`` a vector over
the last axis becomes ``linear(x, w, b)``, which the torch backend runs as one ``addmm``
(the bias is added while the product is written, not in a second pass over it). It runs
on the training graph, after autodiff, as ``linear`` has no VJP.

Needs: a verified graph (a forward graph for ``fold_channel_affine``). Guarantees: the
same values for every output and effect up to float rounding (``conv(x, w) * s`` vs
``conv(x, w * s)``); the replaced nodes are dead afterwards and removed. Only
intermediate values read by nothing else are fused away, so nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pockengine.ir import Graph, GraphBuilder, Node, Value
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["NodeIndex", "Rule", "fold_channel_affine", "fuse_linear_bias", "rewrite"]

Rule = Callable[[GraphBuilder, Node, "NodeIndex", dict[str, Value]], Value | None]


@dataclass(frozen=True)
class NodeIndex:
    """Who makes and who reads each value of a graph, for pattern matching."""

    producers: dict[str, Node]
    users: dict[str, list[Node]]
    outputs: set[str]

    def sole_producer(self, v: Value) -> Node | None:
        """The node making ``v`` if ``v`` has exactly one reader and is not returned."""
        if v.name in self.outputs or len(self.users.get(v.name, ())) != 1:
            return None
        return self.producers.get(v.name)

    def single_use(self, v: Value, op: str) -> Node | None:
        """The node making ``v`` if it is an ``op`` and ``v`` has no other reader."""
        node = self.sole_producer(v)
        return node if node is not None and node.op == op else None


def rewrite(graph: Graph, rule: Rule) -> Graph:
    """Copy ``graph``, letting ``rule`` replace a node by the value it emits instead (the
    node's output is then renamed to that value for every later reader); dead code goes.
    ``graph`` itself when the rule replaced nothing."""
    index = NodeIndex(graph.producers(), graph.users(), {v.name for v in graph.outputs})
    b = GraphBuilder.rewriting(graph)
    renamed: dict[str, Value] = {}
    for node in graph.nodes:
        if any(v.name in renamed for v in node.inputs):
            node = node.replace(inputs=tuple(renamed.get(v.name, v) for v in node.inputs))
        out = rule(b, node, index, renamed)
        if out is None:
            b.append(node)
        else:
            renamed[node.output.name] = out
    if not renamed:
        return graph  # nothing matched: the same graph, not a copy
    return eliminate_dead_code(b.build([renamed.get(v.name, v) for v in graph.outputs]))


@dataclass(frozen=True)
class _Match:
    conv: Node
    mul: Node
    scale: Value  # [C, 1, 1] or [1, C, 1, 1]
    shift: Value


def _per_channel(v: Value, channels: int) -> bool:
    return v.shape in ((channels, 1, 1), (1, channels, 1, 1))


def _other(node: Node, v: Value) -> Value | None:
    """The other operand of a binary node that reads ``v`` once."""
    a, b = node.inputs
    if a.name == v.name and b.name != v.name:
        return b
    if b.name == v.name and a.name != v.name:
        return a
    return None


def _match(add: Node, index: NodeIndex) -> _Match | None:
    """``add(mul(conv2d(...), s), h)`` (operands in either order) with single readers."""
    if add.op != "add":
        return None
    for t in add.inputs:
        mul = index.single_use(t, "mul")
        if mul is None:
            continue
        for y in mul.inputs:
            conv = index.single_use(y, "conv2d")
            if conv is None:
                continue
            scale, shift = _other(mul, y), _other(add, t)
            channels = y.shape[1]
            if (
                scale is not None
                and shift is not None
                and _per_channel(scale, channels)
                and _per_channel(shift, channels)
                and scale.dtype == shift.dtype == y.dtype
                and add.output.shape == y.shape
                and not _reads_trained(scale, index)
            ):
                return _Match(conv, mul, scale, shift)
    return None


def _reads_trained(v: Value, index: NodeIndex) -> bool:
    """Whether ``v`` is computed from a trained param (a BatchNorm's trained scale)."""
    seen: set[str] = set()
    stack = [v]
    while stack:
        value = stack.pop()
        if value.trainable:
            return True
        node = index.producers.get(value.name)
        if node is not None and value.name not in seen:
            seen.add(value.name)
            stack.extend(node.inputs)
    return False


def _folded(b: GraphBuilder, m: _Match, renamed: dict[str, Value]) -> Value:
    x, w, *bias = (renamed.get(v.name, v) for v in m.conv.inputs)
    src = m.conv.source
    channels = w.shape[0]
    scale, shift = (renamed.get(v.name, v) for v in (m.scale, m.shift))
    s = b.call("reshape", scale, shape=(channels,), source=src)
    h = b.call("reshape", shift, shape=(channels,), source=src)
    w_scaled = b.call(
        "mul", w, b.call("reshape", s, shape=(channels, 1, 1, 1), source=src), source=src
    )
    new_bias = b.call("add", b.call("mul", bias[0], s, source=src), h, source=src) if bias else h
    attrs: dict[str, Any] = dict(m.conv.attrs)
    return b.call("conv2d", x, w_scaled, new_bias, source=src, **attrs)


def _fold_rule(
    b: GraphBuilder, node: Node, index: NodeIndex, renamed: dict[str, Value]
) -> Value | None:
    m = _match(node, index)
    return None if m is None else _folded(b, m, renamed)


def fold_channel_affine(graph: Graph) -> Graph:
    return rewrite(graph, _fold_rule)


def _linear_rule(
    b: GraphBuilder, node: Node, index: NodeIndex, renamed: dict[str, Value]
) -> Value | None:
    if node.op != "add":
        return None
    for y in node.inputs:
        mm = index.single_use(y, "matmul")
        bias = _other(node, y)
        if mm is None or bias is None:
            continue
        x, w = (renamed.get(v.name, v) for v in mm.inputs)
        if w.type.rank == 2 and bias.shape == (y.shape[-1],) and node.output.shape == y.shape:
            return b.call("linear", x, w, bias, source=mm.source)
    return None


def fuse_linear_bias(graph: Graph) -> Graph:
    return rewrite(graph, _linear_rule)
