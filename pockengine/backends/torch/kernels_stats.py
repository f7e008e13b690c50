"""Batch norm's running statistics and the step's gated writes, each in few ATen calls.

A training step that tracks a batch norm's running statistics holds, per batch norm, the
IR of ``running = (1 - m) * running + m * stat`` for the mean and the variance (``mul``,
``mul``, ``add``, with the unbiased variance's ``n / (n - 1)`` folded into the
variance's factor), and at its end one ``assign`` per buffer, gated by the ``nonfinite``
flag of the loss. On a small model these are most of the step's calls: 13 per batch norm.

- ``batch_norm`` absorbs (``links.Absorber``) the updates of its running statistics: ATen's
  training-mode ``native_batch_norm`` updates clones of the running mean and variance
  itself, in the same call, and the clones are the updated statistics (the assigns still
  write them, gated). The variance (``1/std^2 - eps``) is computed only when a node
  outside the absorbed ones reads it.
- The first ``assign`` of a run of them absorbs the run: the assigns with the same gate
  and the increments they write (``add(buffer, scalar)``: the batch counts) become one
  call of ``gated_update_``, one host read of the gate on the CPU and then one
  ``_foreach_copy_`` and one ``_foreach_add_`` per increment, instead of a copy, a read
  and an add per buffer. A non-finite step writes none of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pockengine.backends.torch import kernels_nn
from pockengine.backends.torch.codegen import (
    Absorbed,
    Absorber,
    Emit,
    Emitter,
    GraphIndex,
    literal,
)
from pockengine.backends.torch.serial import Probes, serial_call
from pockengine.ir import Graph, Node, Role, Value, get_op

__all__ = ["ABSORBERS", "KERNELS", "NAMESPACE", "gated_update_"]


# -- batch norm and its running statistics ------------------------------------------------------
def _scalar(value: Value, index: GraphIndex) -> float | None:
    """The value of a 0-d ``full``, else None."""
    made = index.producers.get(value.name)
    if made is None or made.op != "full" or made.attrs["shape"] != ():
        return None
    v = made.attrs["value"]
    return float(v) if isinstance(v, int | float) else None


def _scaled(node: Node, index: GraphIndex) -> tuple[Value, float] | None:
    """``mul(x, c)`` or ``mul(c, x)`` with c a 0-d constant: (x, c)."""
    if node.op != "mul" or len(node.inputs) != 2:
        return None
    for k in (0, 1):
        c = _scalar(node.inputs[1 - k], index)
        if c is not None and node.inputs[k].type == node.outputs[0].type:
            return node.inputs[k], c
    return None


def _only_reader(value: Value, index: GraphIndex) -> Node | None:
    readers = index.users.get(value.name, [])
    return readers[0] if len(readers) == 1 else None


def _running_update(
    stat: Value, index: GraphIndex
) -> tuple[list[Node], Value, float, float] | None:
    """``add(mul(running, a), mul(stat, b))`` (either order) reading ``stat``: its nodes
    (stat's mul, running's mul, the add), the running buffer, a and b."""
    for mine in index.users.get(stat.name, []):
        scaled = _scaled(mine, index)
        add = _only_reader(mine.outputs[0], index)
        if scaled is None or scaled[0] != stat or add is None or add.op != "add":
            continue
        others = [v for v in add.inputs if v != mine.outputs[0]]
        theirs = index.producers.get(others[0].name) if len(others) == 1 else None
        found = None if theirs is None else _scaled(theirs, index)
        if theirs is None or found is None or _only_reader(others[0], index) is not add:
            continue
        running, a = found
        if running.role == Role.BUFFER and running.type == stat.type:
            return [mine, theirs, add], running, a, scaled[1]
    return None


def _absorb_running_stats(
    i: int, graph: Graph, index: GraphIndex, _taken: frozenset[int]
) -> Absorbed | None:
    """The running mean's and variance's updates after batch norm ``i``, when they are the
    ones ATen's training-mode batch norm makes with momentum m: (1 - m) * running +
    m * mean, and (1 - m) * running + m * n/(n-1) * var (n: the elements per channel)."""
    node = graph.nodes[i]
    x, (_, mean, var) = node.inputs[0], node.outputs
    n = x.type.numel // x.shape[1] if x.type.rank >= 2 and x.shape[1] else 0
    means, variances = _running_update(mean, index), _running_update(var, index)
    if n < 2 or means is None or variances is None or x.type.dtype != mean.type.dtype:
        return None
    (nodes_m, rm, a_m, m), (nodes_v, rv, a_v, b_v) = means, variances
    factors = ((a_m, 1 - m), (a_v, 1 - m), (b_v, m * n / (n - 1)))
    if rm == rv or not all(math.isclose(p, q, rel_tol=1e-6) for p, q in factors):
        return None
    # nodes before i, or absorbed already, are refused by ``links.absorptions`` itself
    nodes = sorted(index.at(k) for k in (*nodes_m, *nodes_v))
    if _written_between(graph, index, (rm, rv), i, nodes[-1]):
        return None
    binds = (nodes_m[2].outputs[0], nodes_v[2].outputs[0])
    return Absorbed(tuple(nodes), binds, (rm, rv), {"momentum": m})


def _written_between(
    graph: Graph, index: GraphIndex, values: Sequence[Value], lo: int, hi: int
) -> bool:
    """Whether a node between ``lo`` and ``hi`` writes one of ``values`` in place."""
    for value in values:
        for reader in index.users.get(value.name, []):
            writes = any(reader.inputs[k] == value for k in get_op(reader.op).mutates)
            if writes and lo < index.at(reader) <= hi:
                return True
    return False


def _variance_read(e: Emit) -> bool:
    """Whether a node reads batch norm's variance: one it absorbs does not, nor a gradient
    that takes the 1/std it saved (``kernels_nn``'s pair)."""
    var = e.node.outputs[2]
    if var in e.graph.outputs:
        return True
    absorbed = set(e.absorbed.nodes) if e.absorbed else set()
    for reader in e.readers(2):
        if e.index.at(reader) in absorbed:
            continue
        if not (reader.op == "batch_norm_grad" and e.shares_saved(reader)):
            return True
    return False


def _batch_norm(e: Emit) -> list[str]:
    """ATen's training-mode batch norm gives 1/std; the biased variance is 1/std^2 - eps,
    computed where a node reads it (``_variance_read``). With its running statistics
    absorbed, ATen updates clones of them in the same call."""
    x, w, b = e.ins
    y, mean, var = e.outs
    eps = literal(float(e.attr("eps")))
    invstd = e.saved or e.tmp()
    stmts, running = [], "None, None, True, 0.0"
    if e.absorbed is not None:
        rm, rv = (e.name(v) for v in e.absorbed.reads)
        new_m, new_v = (e.name(v) for v in e.absorbed.binds)
        stmts = [f"{new_m} = {rm}.clone()", f"{new_v} = {rv}.clone()"]
        running = f"{new_m}, {new_v}, True, {literal(float(e.absorbed.attrs['momentum']))}"
    call = serial_call(
        e, "aten_native_batch_norm", f"{x}, {w}, {b}, {running}, {eps}", Probes.batch_norm
    )
    stmts.append(f"{y}, {mean}, {invstd} = {call}")
    stmts.append(f"{var} = {invstd}.pow(-2).sub_({eps})" if _variance_read(e) else f"{var} = None")
    return stmts


# -- runs of gated assigns ----------------------------------------------------------------------
def _gate(node: Node) -> str | None:
    return node.inputs[2].name if len(node.inputs) > 2 else None


def _increment(node: Node, index: GraphIndex) -> tuple[Value, float] | None:
    """``add(buffer, c)`` (c a 0-d constant) whose one reader assigns it back to the buffer."""
    if node.op != "add" or len(node.inputs) != 2:
        return None
    buffer, c = node.inputs[0], _scalar(node.inputs[1], index)
    reader = _only_reader(node.outputs[0], index)
    if c is None or buffer.role != Role.BUFFER or reader is None or reader.op != "assign":
        return None
    if reader.inputs[0] != buffer or reader.inputs[1] != node.outputs[0]:
        return None
    return buffer, c


def _absorb_run(i: int, graph: Graph, index: GraphIndex, taken: frozenset[int]) -> Absorbed | None:
    """The assigns after assign ``i`` with its gate, and the increments they write, up to
    the first other node (0-d constants aside): each writing another tensor, none reading
    what the run writes."""
    gate, run, written = _gate(graph.nodes[i]), [i], {graph.nodes[i].inputs[0].name}
    for j in range(i + 1, len(graph.nodes)):
        node = graph.nodes[j]
        if j in taken:
            break
        if node.op == "full" and node.attrs["shape"] == ():
            continue  # a constant (the increments' 1) is bound on its own line, in place
        if node.op == "assign" and _gate(node) == gate and node.inputs[0].name not in written:
            written.add(node.inputs[0].name)
            run.append(j)
        elif _increment(node, index) is None:
            break
        else:
            run.append(j)
    while graph.nodes[run[-1]].op != "assign":
        run.pop()
    # an increment whose assign is not in the run ends the run before it
    inside = set(run)
    for k, j in enumerate(run):
        node = graph.nodes[j]
        if node.op == "add" and index.at(index.users[node.outputs[0].name][0]) not in inside:
            run = run[:k]
            break
    assigns = [graph.nodes[j] for j in run if graph.nodes[j].op == "assign"]
    made = {graph.nodes[j].outputs[0].name for j in run if graph.nodes[j].op == "add"}
    if any(a.inputs[1].name in written and a.inputs[1].name not in made for a in assigns):
        return None
    return Absorbed(tuple(run[1:])) if len(run) > 1 else None


def _assign(e: Emit) -> list[str]:
    """assign (``kernels_nn``); with a run absorbed, one ``gated_update_`` for it all."""
    if e.absorbed is None:
        return kernels_nn.KERNELS["assign"](e)
    nodes = [e.node, *(e.graph.nodes[j] for j in e.absorbed.nodes)]
    copies: list[tuple[str, str]] = []
    steps: dict[float, list[str]] = {}
    increments = {n.outputs[0].name: _increment(n, e.index) for n in nodes if n.op == "add"}
    for n in nodes:
        if n.op != "assign":
            continue
        step = increments.get(n.inputs[1].name)
        if step is None:
            copies.append((e.name(n.inputs[0]), e.name(n.inputs[1])))
        else:
            steps.setdefault(step[1], []).append(e.name(step[0]))
    dsts = ", ".join(d for d, _ in copies)
    srcs = ", ".join(s for _, s in copies)
    adds = ", ".join(f"([{', '.join(ts)}], {literal(_number(c))})" for c, ts in steps.items())
    gate = e.ins[2] if len(e.ins) > 2 else "None"
    return [f"gated_update_([{dsts}], [{srcs}], {gate}, ({adds}{',' if steps else ''}))"]


def _number(c: float) -> int | float:
    """An increment as a literal: an integer one as an int (the batch counts are i64)."""
    return int(c) if c.is_integer() else c


def gated_update_(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    skip: torch.Tensor | None,
    increments: Sequence[tuple[list[torch.Tensor], Any]] = (),
) -> None:
    """dst <- src for each pair and t += c for each increment, unless ``skip`` != 0 (a
    non-finite step). On the CPU the flag is read once; elsewhere ``where`` keeps the step
    free of host reads."""
    if skip is None or skip.device.type == "cpu":
        if skip is not None and skip.item():
            return
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        for tensors, c in increments:
            torch._foreach_add_(tensors, c)
        return
    keep = skip != 0
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(torch.where(keep, dst, src))
    for tensors, c in increments:
        for t in tensors:
            t.copy_(torch.where(keep, t, t + c))


ABSORBERS: dict[str, Absorber] = {
    "batch_norm": _absorb_running_stats,
    "assign": _absorb_run,
}

KERNELS: dict[str, Emitter] = {"batch_norm": _batch_norm, "assign": _assign}

NAMESPACE: dict[str, Callable[..., Any]] = {"gated_update_": gated_update_}
