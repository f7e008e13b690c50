"""Packing causal-LM examples into fixed ``seq_len`` rows, and the loss that keeps them apart.

``pack_examples`` places examples into rows (best fit, longest first, so the rows fill up)
and returns five arrays, one row each: token ids, segment ids (1, 2, ... for the examples of
the row, 0 for padding), per-example positions (0 at each example's first token), next-token
targets and target weights (1 where the target is a trained token of the same example).
``packed_lm_loss`` builds the attention mask from the segments and positions inside the
compiled step (token i sees token j when both are in one example and j is not after i:
block-diagonal and causal, as an additive float mask into the model's attention), so
nothing crosses an example boundary, and averages the next-token loss over the batch's
trained targets, as training on the examples unpacked, padded and with prompt labels at
-100, would.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.tasks.lm_data import LMExample

__all__ = [
    "PACKED_ARRAYS",
    "PackStats",
    "pack_examples",
    "packed_lm_eval",
    "packed_lm_loss",
]
PACKED_ARRAYS = ("ids", "segments", "positions", "targets", "weights")


@dataclass(frozen=True)
class PackStats:
    """What packing did: examples, rows, tokens, padding, the length distribution."""

    examples: int
    rows: int
    seq_len: int
    tokens: int  # example tokens placed
    trained: int  # trained targets
    lengths: tuple[int, int, int, int, int]  # min, median, p90, p99, max

    @property
    def padded_share(self) -> float:
        slots = self.rows * self.seq_len
        return 1.0 - self.tokens / slots if slots else 0.0

    def describe(self, what: str) -> str:
        lo, med, p90, p99, hi = self.lengths
        return (
            f"{what}: {self.examples} examples of {lo}/{med}/{p90}/{p99}/{hi} tokens "
            f"(min/median/p90/p99/max) packed into {self.rows} rows of {self.seq_len}: "
            f"{self.padded_share:.1%} padding, {self.trained} trained tokens"
        )


def _rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Example indices per row: best fit, longest first (rows in the order they opened)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (seq_len - lengths[i], len(rows) - 1))
            continue
        room, row = free.pop(k)
        rows[row].append(i)
        bisect.insort(free, (room - lengths[i], row))
    return rows


def pack_examples(
    examples: Sequence[LMExample], seq_len: int, pad_id: int, *, packing: bool = True
) -> tuple[tuple[Array, ...], PackStats]:
    """The five ``PACKED_ARRAYS`` of ``examples`` (each at most ``seq_len`` tokens): packed,
    or one example a row (``packing=False``)."""
    lengths = [len(e.ids) for e in examples]
    rows = _rows(lengths, seq_len) if packing else [[i] for i in range(len(examples))]
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    seg = np.zeros((n, seq_len), dtype=np.int64)
    pos = np.tile(np.arange(seq_len, dtype=np.int64), (n, 1))
    targets = np.zeros((n, seq_len), dtype=np.int64)
    weights = np.zeros((n, seq_len), dtype=np.float32)
    for r, members in enumerate(rows):
        start = 0
        for s, i in enumerate(members, 1):
            ex, end = examples[i], start + lengths[i]
            ids[r, start:end], seg[r, start:end] = ex.ids, s
            pos[r, start:end] = np.arange(lengths[i])
            targets[r, start : end - 1] = ex.ids[1:]
            weights[r, start : end - 1] = ex.trained[1:]
            start = end
        pos[r, start:] = np.arange(seq_len - start)  # padding: a causal segment of its own
    stats = PackStats(
        len(examples), n, seq_len, sum(lengths), int(weights.sum()), _quantiles(lengths)
    )
    return (ids, seg, pos, targets, weights), stats


def _quantiles(lengths: Sequence[int]) -> tuple[int, int, int, int, int]:
    if not lengths:
        return (0, 0, 0, 0, 0)
    s = sorted(lengths)

    def at(q: float) -> int:
        return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)] if q > 0 else s[0]

    return (s[0], at(0.5), at(0.9), at(0.99), s[-1])


def _token_losses(
    model: nn.Module,
    ids: torch.Tensor,
    seg: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """``[rows, seq]`` next-token losses, attention kept inside each example."""
    same = seg.unsqueeze(2) == seg.unsqueeze(1)
    causal = pos.unsqueeze(1) <= pos.unsqueeze(2)
    zero = torch.zeros((), dtype=torch.float32)
    mask = torch.where(same & causal, zero, torch.full((), -math.inf)).unsqueeze(1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    vocab = logits.shape[-1]
    logp = F.log_softmax(logits.reshape(-1, vocab), dim=-1)
    return -logp.gather(-1, targets.reshape(-1, 1)).reshape(targets.shape)


def packed_lm_loss(
    model: nn.Module,
    ids: torch.Tensor,
    seg: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Mean next-token loss over the batch's trained targets (``weights`` 1)."""
    losses = _token_losses(model, ids, seg, pos, targets)
    return (losses * weights).sum() / torch.clamp(weights.sum(), min=1.0)


def packed_lm_eval(
    model: nn.Module,
    ids: torch.Tensor,
    seg: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """``[summed loss, trained targets]`` over a batch, each row weighted by ``rows``."""
    w = weights * rows.unsqueeze(1)
    losses = _token_losses(model, ids, seg, pos, targets)
    return torch.stack([(losses * w).sum(), w.sum()])
