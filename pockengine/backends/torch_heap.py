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
"""

from __future__ import annotations

from collections.abc import Mapping

from pockengine.ir import Graph
from pockengine.plan.liveness import liveness

__all__ = ["MIN_TRIM_BYTES", "trim_points"]

MIN_TRIM_BYTES = 4 << 20
_DROP_SHARE = 16  # a trim follows a death of at least 1/16 of the planned live peak ...
_BAND = 1 / 2  # ... while the live bytes are at least half of it


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
