"""In-place reuse: which elementwise results may overwrite the buffer of an input that dies.

A node whose op is in ``INPLACE_OPS`` may write its result into the memory of one of its
inputs ``v`` when nothing can read that memory afterwards. ``reusable_inputs`` decides it
from the graph alone, so the memory plan (``plan_memory``) and a backend that acts on it
(the torch backend writes such results with ``out=``) agree. ``v`` qualifies when:

- the result has ``v``'s shape and dtype (no broadcast grows it, no promotion changes it);
- node ``i`` is the last reader of ``v`` and of every value that may share ``v``'s memory:
  values that ``VIEW_OPS`` derive from the same buffer (a backend may implement them as
  views; ``cast`` to the same dtype, ``sum_to`` over no axis and ``stop_gradient`` may
  return their input itself), and earlier results written into that buffer;
- the buffer is the step's own: not a graph input (a batch the caller still holds, a
  param, buffer or optimizer state), nor a compile-time constant (``full``, ``arange``),
  nor reached through ``broadcast_to`` (several elements of the view share one address);
- no other input of node ``i`` shares the buffer in a different view (``add(x, x)`` is
  fine, ``add(x, transpose(x))`` would read elements already overwritten).

A result written in place joins its input's buffer: a later node may overwrite it in turn,
so a chain ``bn -> relu6 -> +residual`` runs in one buffer.
"""

from __future__ import annotations

from pockengine.ir import Graph, Node
from pockengine.plan.liveness import liveness

__all__ = ["CONSTANT_OPS", "INPLACE_OPS", "VIEW_OPS", "reusable_inputs"]

# Ops whose result a backend may make share memory with their first input.
VIEW_OPS = frozenset(
    {"reshape", "transpose", "broadcast_to", "slice", "cast", "sum_to", "stop_gradient"}
)
# Ops whose result may be a compile-time constant (never written).
CONSTANT_OPS = frozenset({"full", "arange"})
# Elementwise ops (and elementwise backward kernels) whose result may overwrite an input.
INPLACE_OPS = frozenset(
    {
        *("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos"),
        *("abs", "reciprocal", "erf", "silu", "gelu", "clamp", "hardtanh"),
        *("add", "sub", "mul", "div", "maximum", "minimum"),
        *("relu_grad", "hardtanh_grad", "gelu_grad"),
    }
)
_FOREIGN = ""  # the root of memory the step does not own


def reusable_inputs(graph: Graph, ops: frozenset[str] = INPLACE_OPS) -> dict[int, int]:
    """Node index -> the position of the input whose buffer its result may take."""
    last = {name: iv.end for name, iv in liveness(graph).intervals.items()}
    root = {v.name: _FOREIGN for v in graph.inputs}  # value -> the buffer it may live in
    writable: dict[str, bool] = {}
    group_end: dict[str, int] = {}  # buffer -> the last read of any value in it
    reuse: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        outs = node.outputs
        if node.op in CONSTANT_OPS:
            root.update((v.name, _FOREIGN) for v in outs)
            continue
        if node.op in VIEW_OPS and outs:
            src = node.inputs[0].name
            r = root.get(src, _FOREIGN)
            root[outs[0].name] = r
            writable[outs[0].name] = writable.get(src, False) and node.op != "broadcast_to"
            group_end[r] = max(group_end.get(r, -1), last[outs[0].name])
            continue
        eligible = node.op in ops and len(outs) == 1
        k = _reusable(i, node, root, writable, group_end) if eligible else None
        if k is not None:
            reuse[i] = k
            r = root[node.inputs[k].name]
            root[outs[0].name] = r
            group_end[r] = max(group_end[r], last[outs[0].name])
        else:
            for v in outs:
                root[v.name] = v.name
                group_end[v.name] = last[v.name]
        for v in outs:
            writable[v.name] = True
    return reuse


def _reusable(
    i: int,
    node: Node,
    root: dict[str, str],
    writable: dict[str, bool],
    group_end: dict[str, int],
) -> int | None:
    """The first input of node ``i`` whose buffer its result may take, if any."""
    out = node.outputs[0]
    for k, v in enumerate(node.inputs):
        r = root.get(v.name, _FOREIGN)
        if r == _FOREIGN or not writable.get(v.name, False):
            continue
        if v.shape != out.shape or v.dtype != out.dtype or group_end.get(r) != i:
            continue
        if any(root.get(u.name) == r and u.name != v.name for u in node.inputs):
            continue
        return k
    return None
