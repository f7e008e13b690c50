"""The trainer's frozen tensors: one file ``./train`` maps read-only, and its C table.

Frozen params (``param(frozen)``: float matrices, or the codes and scales of low-bit
blocks) and lifted constants are never written by a step, so the trainer does not copy
them into its state block: it ``mmap``s ``frozen.bin`` ``PROT_READ``/``MAP_PRIVATE`` and
points each tensor into the mapping (``trainer/pe_frozen.c``). A write to one would be a
SIGSEGV; the pages are the page cache's, shared and dropped under memory pressure.

``frozen.bin`` is laid out as a safetensors file whose data starts, and each tensor's data
starts, at a multiple of 64 bytes (the header is padded with spaces, the gaps between
tensors are zeros); ``read_safetensors`` reads it. Its own file and not the GGUF the
weights came from: the step reads the blocks split into separate code and scale arrays
(``tasks.gguf.decode_blocks``), not GGUF's interleaved 18- or 20-byte blocks, and int4/int8
groups have no GGUF at all. ``frozen.c`` is the layout the step was compiled for: each
frozen input's position in ``pe_inputs`` and its byte offset in the file, and the file's
size, and a 64-bit digest of the tensors' bytes (``frozen_digest``); ``./train`` refuses
a file whose header, offsets, size or digest differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from pockengine.ir import Graph, Role, Value
from pockengine.ir.arrays import Array
from pockengine.safetensors_io import SAFETENSORS_DTYPES

__all__ = [
    "ALIGN",
    "FROZEN_FILE",
    "FrozenLayout",
    "frozen_digest",
    "frozen_inputs",
    "frozen_layout",
    "frozen_source",
    "is_frozen",
    "write_frozen_to",
]

FROZEN_FILE = "frozen.bin"
ALIGN = 64
_ST_NAME = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
_STEP = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_CHUNK_WORDS = 1 << 20


def is_frozen(v: Value) -> bool:
    """A graph input no step writes: a frozen param or a lifted constant."""
    return (v.role is Role.PARAM and not v.trainable) or v.role is Role.CONST


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class FrozenLayout:
    """Where each frozen tensor lies in the file: ``offsets`` (file name -> absolute byte
    offset, a multiple of ``ALIGN``), the padded header and the file's size."""

    header: bytes
    offsets: dict[str, int]
    size: int
    digest: int


def frozen_layout(tensors: Mapping[str, Array]) -> FrozenLayout:
    """The layout of ``tensors`` (file name -> C-ordered array), in the mapping's order."""
    entries: dict[str, object] = {"__metadata__": {"format": "pockengine-frozen", "align": "64"}}
    at = 0
    relative = {}
    for name, a in tensors.items():
        entries[name] = {"dtype": _ST_NAME[a.dtype], "shape": list(a.shape),
                         "data_offsets": [at, at + a.nbytes]}  # fmt: skip
        relative[name] = at
        at = _up(at + a.nbytes)
    text = json.dumps(entries, separators=(",", ":")).encode()
    start = _up(8 + len(text))
    header = (start - 8).to_bytes(8, "little") + text + b" " * (start - 8 - len(text))
    offsets = {name: start + lo for name, lo in relative.items()}
    last = max((offsets[n] + a.nbytes for n, a in tensors.items()), default=start)
    return FrozenLayout(header, offsets, last, frozen_digest(list(tensors.values())))


def frozen_digest(arrays: Sequence[Array]) -> int:
    """A 64-bit digest of the arrays' bytes, in order (``pe_frozen_digest`` in C).

    Each array's bytes, zero-padded to whole little-endian 64-bit words, are numbered on
    from the previous array's; word ``j`` adds ``mix(w + (j + 1) * STEP)`` (mod 2**64), where
    ``mix(x)`` is ``x ^= x >> 32; x *= MIX; x ^= x >> 29``. A sum of independently mixed
    words: position-dependent, computed chunk by chunk here and in one vectorisable loop by
    ``./train``. It detects a changed or exchanged file, not a crafted one."""
    total = np.uint64(0)
    j = 0
    with np.errstate(over="ignore"):
        for a in arrays:
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            for lo in range(0, raw.size, 8 * _CHUNK_WORDS):
                part = raw[lo : lo + 8 * _CHUNK_WORDS]
                if part.size % 8:
                    part = np.concatenate([part, np.zeros(8 - part.size % 8, np.uint8)])
                w = part.view("<u8").astype(np.uint64)
                x = w + (np.arange(j + 1, j + 1 + w.size, dtype=np.uint64) * _STEP)
                x ^= x >> np.uint64(32)
                x *= _MIX
                x ^= x >> np.uint64(29)
                total += np.add.reduce(x, dtype=np.uint64)
                j += w.size
    return int(total)


def write_frozen_to(f: IO[bytes], layout: FrozenLayout, tensors: Mapping[str, Array]) -> None:
    """Write ``tensors`` into ``f`` as ``layout`` places them (each array's own bytes)."""
    f.write(layout.header)
    at = len(layout.header)
    for name, a in tensors.items():
        f.write(b"\0" * (layout.offsets[name] - at))
        f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        at = layout.offsets[name] + a.nbytes


def frozen_source(graph: Graph, names: Mapping[str, str], layout: FrozenLayout) -> str:
    """``frozen.c``: the table ``pe_frozen`` (pe_frozen.h) of each frozen input's position
    in ``graph.inputs`` and its offset in the file, the file's size and its digest."""
    rows = [
        f"    {{{k}, INT64_C({layout.offsets[names[v.name]]})}},"
        for k, v in enumerate(graph.inputs)
        if names[v.name] in layout.offsets and is_frozen(v)
    ]
    return "\n".join([
        "/* Generated by pockengine: the frozen tensors ./train maps from frozen.bin, each",
        " * one's position in pe_inputs and byte offset in the file (pe_frozen.h). */",
        '#include "pe_frozen.h"',
        "",
        f"const int pe_num_frozen = {len(rows)};",
        f"const int64_t pe_frozen_file_bytes = INT64_C({layout.size if rows else 0});",
        f"const uint64_t pe_frozen_digest = UINT64_C({layout.digest if rows else 0});",
        f"const pe_frozen_info pe_frozen[{max(len(rows), 1)}] = {{",
        *(rows or ["    {-1, 0},"]),
        "};",
    ]) + "\n"  # fmt: skip


def frozen_inputs(graph: Graph) -> Sequence[Value]:
    """The graph's frozen inputs, in input order."""
    return [v for v in graph.inputs if is_frozen(v)]
