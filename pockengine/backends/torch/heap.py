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

Where ATen has no ``out=`` form (the fused flash-attention kernels) or its ``out=`` form
computes more than the node asks for (``native_layer_norm_backward.out`` insists on the
weight and bias gradients), the kernel allocates its result and copies it into the slot
at once, in the layout ATen gave it (``COPIED_OPS``, ``kernels.to_slot``): the
allocator then serves that block for one line only, and the same block again at the next
such node, so the step's long-lived large tensors are all in the workspace and glibc's
heap holds nothing large across a step (a copy of 1.5 MiB costs about 0.1 ms).

``keep_step_heap(live_peak)`` is the default policy on the CPU: glibc's mmap threshold
fixed at its 32 MiB ceiling and its trim threshold at twice the largest live peak of the
steps compiled so far (at least twice the mmap threshold, glibc's own ratio). Every
intermediate up to 32 MiB then comes from the heap, and the heap a step frees is not given
back at its end, so the next step reuses the same pages instead of mapping them afresh
(MobileNetV2 batch 8: 42,000 minor page faults a step, 166 MiB of zeroed pages, with
glibc's adaptive thresholds and the trims near the peak; none with the step heap). What
the process keeps between steps is the step's own high-water mark, bounded by the trim
threshold: a larger free top, left by other work in the process, still goes back.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from pockengine._libc import libc_function
from pockengine.ir import CompileError, Fact, Graph, Node, Value, get_op
from pockengine.plan.liveness import Interval, last_reads, liveness
from pockengine.plan.memory import place_intervals

__all__ = [
    "LARGE_SLOT_BYTES",
    "MIN_TRIM_BYTES",
    "MIN_WORKSPACE_BYTES",
    "MMAP_THRESHOLD_MAX",
    "WORKSPACE_OPS",
    "Workspace",
    "checked_thresholds",
    "fix_heap_thresholds",
    "keep_step_heap",
    "kept_trim_threshold",
    "plan_workspace",
    "trim_points",
]

MIN_TRIM_BYTES = 4 << 20
_FOREIGN = ""  # the root of memory the step does not own (graph inputs, constants)
_DROP_SHARE = 16  # a trim follows a death of at least 1/16 of the planned live peak ...
_BAND = 1 / 2  # ... while the live bytes are at least half of it
MIN_WORKSPACE_BYTES = 64 << 10  # smaller results stay with the allocator
# the ops whose torch kernels put a result into a given tensor (``Emit.dest``): ``out=``, or
# a copy at once (``COPIED_OPS``)
WORKSPACE_OPS = frozenset(
    {
        "linear",
        "matmul",
        "gelu",
        "gelu_grad",
        "add",
        "sub",
        "mul",
        "div",
        "layer_norm",
        "layer_norm_grad",
        "attention",
        "attention_grad",
        "embedding",
        "concat",
        "pad",
        "slice_grad",
        "sum",
        # the unary elementwise ops (``kernels._UNARY``) and silu
        "neg",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "sigmoid",
        "relu",
        "sin",
        "cos",
        "abs",
        "reciprocal",
        "erf",
        "log1p",
        "silu",
        # the fused loss head's gradients and an embedding table's (vocab x hidden, often
        # above glibc's mmap ceiling)
        "linear_log_softmax_gather_grad",
        "linear_log_softmax_gather_with_grad",
        "embedding_grad",
    }
)
COPIED_OPS = frozenset({"layer_norm_grad", "attention", "attention_grad"})
_LOSS_GRADS = {"linear_log_softmax_gather_grad": 0, "linear_log_softmax_gather_with_grad": 2}
# ops whose ``out=`` result never casts whatever their inputs' dtypes (a row gather and its
# gradient; the loss head's gradients, whose integer input is the class index)
_ANY_INPUT_DTYPE = COPIED_OPS | {"embedding", "embedding_grad", *_LOSS_GRADS}
# the results of a multi-result op that get slots (not statistics, nor parameter gradients)
_SLOTTED_RESULTS = {"layer_norm": (0,), "layer_norm_grad": (0,), "attention": (0,),
                    "attention_grad": (0, 1, 2)}  # fmt: skip


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
# the results the step heap cannot keep: glibc maps every block of at least its mmap
# threshold on its own and unmaps it at its ``free``, so the step heap gives them
# workspace slots instead (``TorchBackend``, ``large_slots``)
LARGE_SLOT_BYTES = MMAP_THRESHOLD_MAX


@dataclass
class _Thresholds:
    """What this module set in glibc: the trim threshold ``keep_step_heap`` raised the
    heap to (0: never), and whether someone chose fixed thresholds explicitly."""

    step_trim: int = 0
    explicit: bool = False


_SET = _Thresholds()


@functools.cache
def fix_heap_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Fix glibc's mmap threshold at ``mmap_bytes`` and its trim threshold at ``trim_bytes``
    for the whole process. Blocks of at least ``mmap_bytes`` are mapped on their own and
    unmapped at their ``free``; smaller ones come from the heap, whose free top is given
    back to the OS once it exceeds ``trim_bytes``. glibc's default thresholds are dynamic:
    the mmap threshold rises to the largest block freed so far (up to 32 MiB) and the trim
    threshold to twice that, so the history of the process decides whether a large
    short-lived tensor lands in the heap (and leaves fragments resident there) or costs
    page faults every time. With a workspace holding every large result a step keeps,
    what still reaches ``malloc`` is small, plus a few kernel temporaries (the results
    ``COPIED_OPS`` copy, flash attention's buffers: ~1.5 MiB each, freed on their line):
    an mmap threshold above those and a trim threshold above their sum keep them in the
    top of the heap, reused call after call without page faults, and the resident size
    follows the live bytes. True if set (False off glibc). Process-wide and not undone
    (glibc has no getter to restore the adaptive thresholds), so opt-in:
    ``TorchBackend(heap_thresholds=...)``."""
    _SET.explicit = True  # the step heap leaves a chosen setting alone
    return _set_thresholds(mmap_bytes, trim_bytes)


def _set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    done = mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1 and done)


def keep_step_heap(live_peak: int) -> bool:
    """Let the heap keep a step's buffers between its runs (the module docstring): glibc's
    mmap threshold at ``MMAP_THRESHOLD_MAX`` and its trim threshold raised, never lowered,
    to ``max(2 * live_peak, 2 * MMAP_THRESHOLD_MAX)``, where ``live_peak`` is the step's
    planned peak of live intermediates (``Liveness.peak_bytes``). Process-wide, like every
    glibc setting; a no-op once thresholds were chosen explicitly (``fix_heap_thresholds``,
    ``keep_freed_heap``). True where the thresholds are in place (False off glibc, or
    after an explicit choice)."""
    if _SET.explicit:
        return False
    trim = max(2 * live_peak, 2 * MMAP_THRESHOLD_MAX)
    if trim <= _SET.step_trim:
        return True
    if not _set_thresholds(MMAP_THRESHOLD_MAX, trim):
        return False
    _SET.step_trim = trim
    return True


def kept_trim_threshold() -> int:
    """The trim threshold ``keep_step_heap`` set (0 where it set none)."""
    return _SET.step_trim


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
    """Value name -> the byte offset of that node result in one buffer of ``nbytes`` bytes."""

    offsets: Mapping[str, int]
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


def _slotted(node: Node, ops: frozenset[str], min_bytes: int) -> tuple[int, ...]:
    """The results of ``node`` that get a slot: float results of an op whose kernel puts
    them into a given tensor (its only result, or those ``_SLOTTED_RESULTS`` names), big
    enough; with an ``out=`` that could cast (not ``_ANY_INPUT_DTYPE``) only where every
    input has the result's dtype."""
    if node.op not in ops:
        return ()
    picked = _SLOTTED_RESULTS.get(node.op, (0,) if len(node.outputs) == 1 else ())
    if node.op in _LOSS_GRADS:  # the gradients, from this result on (all of them slotted)
        picked = tuple(range(_LOSS_GRADS[node.op], len(node.outputs)))
    dtype = node.outputs[0].dtype
    if node.op not in _ANY_INPUT_DTYPE and any(v.dtype != dtype for v in node.inputs):
        return ()
    return tuple(k for k in picked if _float_and_large(node.outputs[k], min_bytes))


def _float_and_large(value: Value, min_bytes: int) -> bool:
    return value.dtype.is_float and value.type.nbytes >= min_bytes


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
    intervals: list[Interval] = []
    for i, node in enumerate(graph.nodes):
        if i in reuse:
            continue
        for k in _slotted(node, ops, min_bytes):
            out = node.outputs[k]
            # (a result read by no later node needs no slot: it dies on its own line)
            if root.get(out.name) == out.name and out.name not in outputs and end[out.name] > i:
                intervals.append(Interval(out, i, end[out.name]))
    offsets = place_intervals(intervals)
    size = max((offsets[iv.value.name] + iv.nbytes for iv in intervals), default=0)
    return Workspace(offsets, size)


def checked_thresholds(
    thresholds: tuple[int, int] | None, keep_heap: bool
) -> tuple[int, int] | None:
    """``TorchBackend``'s ``heap_thresholds``, validated: ``(mmap_bytes, trim_bytes)``."""
    if thresholds is None:
        return None
    where = f"TorchBackend(heap_thresholds={thresholds!r})"
    if not isinstance(thresholds, tuple) or len(thresholds) != 2:
        raise CompileError(f"{where}: a pair (mmap_bytes, trim_bytes)")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in thresholds):
        raise CompileError(f"{where}: both thresholds are numbers of bytes (int)")
    mmap_bytes, trim_bytes = thresholds
    if not 0 < mmap_bytes <= MMAP_THRESHOLD_MAX:
        raise CompileError(f"{where}: glibc's mmap threshold is 1 to {MMAP_THRESHOLD_MAX} bytes")
    if trim_bytes <= 0:
        raise CompileError(f"{where}: the trim threshold must be positive")
    if keep_heap:
        raise CompileError(f"{where}: keep_heap=True fixes both thresholds itself; choose one")
    return mmap_bytes, trim_bytes
