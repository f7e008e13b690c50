"""Fusion of forward patterns into fewer, larger kernels.

``fold_channel_affine``: a convolution whose output is only scaled and shifted per output
channel, ``conv2d(x, w, b) * s + h`` with ``s`` and ``h`` of shape [C, 1, 1] (an eval-mode
BatchNorm, as the frontends lower a frozen one), becomes ``conv2d(x, w * s, b * s + h)``.
The scaled weight costs one pass over the weight per step instead of two over the
activation, and the backward needs no per-channel multiply either: autodiff, which runs
after this pass, differentiates the folded form (into ``w``, ``s`` and ``h`` where they
train, so trained BatchNorm affine params still get their gradients).

Needs: a verified forward graph. Guarantees: the same values for every output and effect
up to float rounding (``conv(x, w) * s`` vs ``conv(x, w * s)``); the replaced conv and
multiply are dead afterwards and removed. Only a conv and a multiply read by nothing else
are folded, so no value is computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pockengine.ir import Graph, GraphBuilder, Node, Value
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["fold_channel_affine"]


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


def _match(add: Node, producers: dict[str, Node], users: dict[str, list[Node]]) -> _Match | None:
    """``add(mul(conv2d(...), s), h)`` (operands in either order) with single readers."""
    if add.op != "add":
        return None
    for t in add.inputs:
        mul = producers.get(t.name)
        if mul is None or mul.op != "mul" or len(users.get(t.name, ())) != 1:
            continue
        for y in mul.inputs:
            conv = producers.get(y.name)
            if conv is None or conv.op != "conv2d" or len(users.get(y.name, ())) != 1:
                continue
            scale, shift = _other(mul, y), _other(add, t)
            channels = y.shape[1]
            if (
                scale is not None and shift is not None
                and _per_channel(scale, channels) and _per_channel(shift, channels)
                and scale.dtype == shift.dtype == y.dtype and add.output.shape == y.shape
            ):  # fmt: skip
                return _Match(conv, mul, scale, shift)
    return None


def _folded(b: GraphBuilder, m: _Match, renamed: dict[str, Value]) -> Value:
    x, w, *bias = (renamed.get(v.name, v) for v in m.conv.inputs)
    src = m.conv.source
    channels = w.shape[0]
    scale, shift = (renamed.get(v.name, v) for v in (m.scale, m.shift))
    s = b.call("reshape", scale, shape=(channels,), source=src)
    h = b.call("reshape", shift, shape=(channels,), source=src)
    w_scaled = b.call("mul", w, b.call("reshape", s, shape=(channels, 1, 1, 1), source=src),
                      source=src)  # fmt: skip
    new_bias = b.call("add", b.call("mul", bias[0], s, source=src), h, source=src) if bias else h
    attrs: dict[str, Any] = dict(m.conv.attrs)
    return b.call("conv2d", x, w_scaled, new_bias, source=src, **attrs)


def fold_channel_affine(graph: Graph) -> Graph:
    producers = graph.producers()
    users = graph.users()
    outputs = {v.name for v in graph.outputs}
    b = GraphBuilder(graph.name)
    for v in graph.inputs:
        b.add_input(v)
    renamed: dict[str, Value] = {}
    for node in graph.nodes:
        if any(v.name in renamed for v in node.inputs):
            node = node.replace(inputs=tuple(renamed.get(v.name, v) for v in node.inputs))
        m = _match(node, producers, users)
        if m is not None and not outputs & {m.conv.output.name, m.mul.output.name}:
            renamed[node.output.name] = _folded(b, m, renamed)
        else:
            b.append(node)
    return eliminate_dead_code(b.build([renamed.get(v.name, v) for v in graph.outputs]))
