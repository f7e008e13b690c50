"""Where the torch backend hands freed heap pages back during a run (CPU, glibc).

The generated function allocates every intermediate through torch's CPU allocator, that is
glibc's ``malloc``. Between two steps the heap holds the freed blocks of the last one and,
within a step, blocks freed early are reused only where a later tensor fits: near the
step's planned peak the heap holds the live tensors *and* the resident pages of free blocks
no live tensor fits in. On minilm-bbc's sparse step (live peak 186 MiB) that slack was
about 80 MiB at the process's peak (``mallinfo2``: 302 MiB in use, 81 free in a 383 MiB
heap), which no memory plan sees.

``trim_points(graph, reuse)`` reads the step's own liveness: the nodes after which a large
share of the planned live bytes dies (at least 1/16 of the planned live peak, and at least
``MIN_TRIM_BYTES``) while the live bytes are still at least half the peak. The
backend ends each such node's line with ``malloc_trim(0)``, which hands the free blocks'
pages back to the OS (no allocation moves, no value changes: results are bit for bit the
same), so the blocks the peak does not reuse stop counting as resident. It is a call, not
a process-wide setting. Graphs whose live peak is under ``16 * MIN_TRIM_BYTES`` get none.

``plan_workspace(graph, reuse, ops)`` is the other way out of the heap: a workspace, one
buffer the executable allocates once and keeps between calls, in which the results of the
large nodes of ``ops`` (kernels that can write into a given tensor: ``addmm``, ``mm``,
``gelu``, ... with ``out=``) get fixed offsets, so they cost no ``malloc``, no page faults
and no fragmentation, whatever glibc's thresholds. A slot's lifetime is its *buffer's*:
from its node to the last read of any value that may share that memory (views of it,
``Fact.VIEW``, and results written over it in place, ``plan.inplace``), which the memory
plan's per-value liveness does not track (it gives a view a buffer of its own). Slots
are placed as the memory plan places values (``plan.memory.place_intervals``). A buffer
any value of which is a graph output never gets a slot: the caller keeps outputs past the
call, and the next call would overwrite them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pockengine.ir import Fact, Graph, Node, get_op
from pockengine.plan.liveness import Interval, last_reads, liveness
from pockengine.plan.memory import place_intervals

__all__ = [
    "MIN_TRIM_BYTES",
    "MIN_WORKSPACE_BYTES",
    "WORKSPACE_OPS",
    "Workspace",
    "plan_workspace",
    "trim_points",
]

MIN_TRIM_BYTES = 4 << 20
_FOREIGN = ""  # the root of memory the step does not own (graph inputs, constants)
_DROP_SHARE = 16  # a trim follows a death of at least 1/16 of the planned live peak ...
_BAND = 1 / 2  # ... while the live bytes are at least half of it
MIN_WORKSPACE_BYTES = 64 << 10  # smaller results stay with the allocator
# the ops whose torch kernels write a result into a given tensor (``Emit.dest``)
WORKSPACE_OPS = frozenset({"linear", "matmul", "gelu", "gelu_grad", "add", "mul", "layer_norm"})
_FIRST_RESULT_OPS = frozenset({"layer_norm"})  # a slot for result 0 only (y, not statistics)


def trim_points(graph: Graph, reuse: Mapping[int, int]) -> tuple[int, ...]:
    """The node indices after which a run of ``graph`` (with in-place ``reuse``, as the
    code generator writes it) trims the heap: see the module docstring."""
    live = liveness(graph, reuse).live_bytes()
    peak = max(live, default=0)
    drop = max(peak // _DROP_SHARE, MIN_TRIM_BYTES)
    if peak < _DROP_SHARE * MIN_TRIM_BYTES:
        return ()
    return tuple(
        k for k in range(len(live) - 1) if live[k] >= _BAND * peak and live[k] - live[k + 1] >= drop
    )


@dataclass(frozen=True)
class Workspace:
    """Node index -> the byte offset of its result in one buffer of ``nbytes`` bytes."""

    offsets: Mapping[int, int]
    nbytes: int


def _buffer_ends(graph: Graph, reuse: Mapping[int, int]) -> tuple[dict[str, str], dict[str, int]]:
    """Value -> the node result whose buffer it may live in (``_FOREIGN`` for graph inputs and
    what views them), and buffer -> the last read of any value in it."""
    last = last_reads(graph)
    root = {v.name: _FOREIGN for v in graph.inputs}
    end: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        k = 0 if opdef.has(Fact.VIEW) and node.outputs else reuse.get(i)
        if opdef.has(Fact.CONSTANT):
            root.update((v.name, _FOREIGN) for v in node.outputs)
            continue
        for v in node.outputs:
            r = v.name if k is None else root.get(node.inputs[k].name, _FOREIGN)
            root[v.name] = r
            end[r] = max(end.get(r, -1), last[v.name])
    return root, end


def _slot_worthy(node: Node, ops: frozenset[str], min_bytes: int) -> bool:
    """A float result 0 of an op whose kernel writes into a given tensor, big enough, with
    every input of the result's dtype (``out=`` then never casts); its only result, or
    the first of an op in ``_FIRST_RESULT_OPS``."""
    if node.op not in ops or not (len(node.outputs) == 1 or node.op in _FIRST_RESULT_OPS):
        return False
    out = node.outputs[0]
    same = all(v.dtype == out.dtype for v in node.inputs)
    return out.dtype.is_float and same and out.type.nbytes >= min_bytes


def plan_workspace(
    graph: Graph,
    reuse: Mapping[int, int],
    ops: frozenset[str],
    min_bytes: int | None = None,
) -> Workspace:
    """Workspace offsets for the results of ``graph``'s nodes of ``ops`` of at least
    ``min_bytes`` (default ``MIN_WORKSPACE_BYTES``; see the module docstring); ``reuse``:
    the in-place writes the code generator makes."""
    min_bytes = MIN_WORKSPACE_BYTES if min_bytes is None else min_bytes
    root, end = _buffer_ends(graph, reuse)
    outputs = {root.get(v.name, _FOREIGN) for v in graph.outputs}
    intervals: dict[int, Interval] = {}
    for i, node in enumerate(graph.nodes):
        if i in reuse or not _slot_worthy(node, ops, min_bytes):
            continue
        out = node.outputs[0]
        if root.get(out.name) == out.name and out.name not in outputs:
            intervals[i] = Interval(out, i, end[out.name])
    offsets = place_intervals(list(intervals.values()))
    at = {i: offsets[iv.value.name] for i, iv in intervals.items()}
    size = max((at[i] + iv.nbytes for i, iv in intervals.items()), default=0)
    return Workspace(at, size)
