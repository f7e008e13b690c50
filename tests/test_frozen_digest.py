"""The digest of ``frozen.bin``'s tensors (``frozen_file.frozen_digest``).

The exported trainer recomputes it over its mapping (``pe_frozen.c``); the C side is
checked end to end in ``test_c_trainer_mmap.py``. Here: the reference formula, word by
word in plain Python, equals the chunked NumPy one for sizes that are and are not whole
words, and a changed, moved or exchanged byte changes the digest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pockengine.backends.c import frozen_file
from pockengine.backends.c.frozen_file import frozen_digest, frozen_layout

Array = np.ndarray[Any, Any]
M64 = (1 << 64) - 1


def _reference(arrays: list[Array]) -> int:
    total, j = 0, 0
    for a in arrays:
        raw = np.ascontiguousarray(a).tobytes()
        raw += b"\0" * (-len(raw) % 8)
        for i in range(0, len(raw), 8):
            j += 1
            x = (int.from_bytes(raw[i : i + 8], "little") + j * 0x9E3779B97F4A7C15) & M64
            x ^= x >> 32
            x = (x * 0xBF58476D1CE4E5B9) & M64
            x ^= x >> 29
            total = (total + x) & M64
    return total


@pytest.mark.parametrize("chunk_words", [1, 3, 1 << 20])
def test_digest_is_the_word_formula_in_chunks(monkeypatch: pytest.MonkeyPatch,
                                              chunk_words: int) -> None:  # fmt: skip
    monkeypatch.setattr(frozen_file, "_CHUNK_WORDS", chunk_words)
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((5, 7)).astype(np.float32),  # 140 bytes: a partial last word
        rng.integers(0, 255, 13, dtype=np.uint8),
        rng.standard_normal(6).astype(np.float16),
        np.zeros(0, np.float32),
    ]
    assert frozen_digest(arrays) == _reference(arrays)


def test_a_changed_moved_or_exchanged_byte_changes_the_digest() -> None:
    a = np.arange(24, dtype=np.uint8)
    b = np.arange(100, 117, dtype=np.uint8)
    base = frozen_digest([a, b])
    changed = a.copy()
    changed[23] ^= 1
    assert frozen_digest([changed, b]) != base
    assert frozen_digest([b, a]) != base
    swapped = a.copy()
    swapped[[0, 8]] = swapped[[8, 0]]
    assert frozen_digest([swapped, b]) != base
    assert frozen_layout({"a": a, "b": b}).digest == base
