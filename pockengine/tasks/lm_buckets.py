"""Length buckets for causal-LM examples trained one a row (``--packing off``).

Padding every example to the longest wastes most of a step on data whose lengths are
long-tailed. ``choose_buckets`` picks at most ``max_buckets`` row lengths (the longest
example's length always one of them) that minimise the padded tokens when each example is
padded to the smallest bucket that holds it, by dynamic programming over the sorted
lengths, each bucket holding at least one batch of examples. ``bucket_examples`` lays the
examples out one a row (``lm_pack.PACKED_ARRAYS``), padded to the largest bucket and
sorted by length; ``fit_batch`` cuts a batch to the smallest bucket its longest row fits
(the padding cut off holds no token and no target, so the loss is unchanged) and
``epoch_order`` draws each epoch's batches from one bucket each: every bucket's rows
shuffled with the seed and cut into batches, the batches shuffled, the rows left over
from each bucket's last partial batch placed after them, shortest first. The trainer
compiles one step a bucket over one store (``pockengine.step.bucketed.BucketedStep``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pockengine.ir.arrays import Array
from pockengine.step.bucketed import BucketedStep
from pockengine.step.compiler import TrainStep
from pockengine.tasks.lm_data import LMExample
from pockengine.tasks.lm_pack import _quantiles, pack_examples

# The padded share of the buckets' rows at which the default run stops adding buckets: below
# 10%, since each bucket's left-over rows run in batches as wide as their longest row needs.
ENOUGH_PADDING = 0.08

__all__ = [
    "ENOUGH_PADDING",
    "BucketStats",
    "bucket_examples",
    "choose_buckets",
    "compile_bucketed",
    "epoch_order",
    "fit_batch",
    "padded_tokens",
    "row_lengths",
]


def padded_tokens(lengths: Sequence[int], buckets: Sequence[int]) -> int:
    """Padding when each length is padded to the smallest of ``buckets`` that holds it."""
    edges = sorted(buckets)
    return sum(edges[bisect.bisect_left(edges, n)] - n for n in lengths)


def choose_buckets(
    lengths: Sequence[int], max_buckets: int, min_count: int = 1, enough: float | None = None
) -> tuple[int, ...]:
    """At most ``max_buckets`` bucket lengths, ascending, the last the longest of
    ``lengths``, that minimise ``padded_tokens``; each bucket holds at least ``min_count``
    examples (fewer buckets where the data cannot fill them). With ``enough`` (a share of
    the padded rows' tokens, e.g. 0.1), the fewest buckets whose least padding is at most
    that share, each bucket one compiled step; the least padding where none reaches it."""
    if not lengths:
        return ()
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    n = len(s)
    prefix = np.concatenate([[0], np.cumsum(s)]).astype(np.float64)
    # a bucket may end only after the last example of a length: ``ends[e]`` examples below
    ends = np.asarray([j for j in range(1, n + 1) if j == n or s[j] != s[j - 1]])
    top = s[ends - 1].astype(np.float64)  # the bucket length ending at each end
    # best[k, e]: least padding of the first ends[e] examples in k buckets
    best = np.full((max_buckets + 1, len(ends)), np.inf)
    back = np.full((max_buckets + 1, len(ends)), -1, dtype=np.int64)
    best[1] = np.where(ends >= min_count, top * ends - prefix[ends], np.inf)
    for k in range(2, max_buckets + 1):
        for e in range(1, len(ends)):
            j, i = ends[e], ends[:e]
            cost = best[k - 1, :e] + top[e] * (j - i) - (prefix[j] - prefix[i])
            cost[j - i < min_count] = np.inf
            d = int(np.argmin(cost))
            best[k, e], back[k, e] = cost[d], d
    last = len(ends) - 1
    feasible = [k for k in range(1, max_buckets + 1) if best[k, last] < np.inf]
    if not feasible:  # fewer examples than min_count: one bucket
        return (int(s[-1]),)
    k = min(feasible, key=lambda k: (best[k, last], k))
    if enough is not None:  # padding <= enough * (tokens + padding)
        allowed = enough / (1.0 - enough) * float(prefix[-1])
        k = min((f for f in feasible if best[f, last] <= allowed), default=k)
    out, e = [], last
    while k >= 1 and e >= 0:
        out.append(int(top[e]))
        e, k = int(back[k, e]), k - 1
    return tuple(sorted(out))


@dataclass(frozen=True)
class BucketStats:
    """The buckets of a split: lengths, rows in each, tokens and padding."""

    buckets: tuple[int, ...]
    counts: tuple[int, ...]  # rows per bucket
    tokens: int  # example tokens
    trained: int  # trained targets
    lengths: tuple[int, int, int, int, int]  # min, median, p90, p99, max
    pad_to_max: int  # the row length of pad-to-max (``--seq-len``)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def padded_share(self) -> float:
        slots = sum(b * c for b, c in zip(self.buckets, self.counts, strict=True))
        return 1.0 - self.tokens / slots if slots else 0.0

    @property
    def pad_to_max_share(self) -> float:
        slots = self.rows * self.pad_to_max
        return 1.0 - self.tokens / slots if slots else 0.0

    def describe(self, what: str) -> str:
        lo, med, p90, p99, hi = self.lengths
        each = ", ".join(f"{c} of {b}" for b, c in zip(self.buckets, self.counts, strict=True))
        return (
            f"{what}: {self.rows} examples of {lo}/{med}/{p90}/{p99}/{hi} tokens "
            f"(min/median/p90/p99/max) in {len(self.buckets)} length buckets ({each} "
            f"tokens): {self.padded_share:.1%} padding (padded to {self.pad_to_max}: "
            f"{self.pad_to_max_share:.1%}), {self.trained} trained tokens"
        )


def bucket_examples(
    examples: Sequence[LMExample], buckets: Sequence[int], pad_id: int, seq_len: int
) -> tuple[tuple[Array, ...], BucketStats]:
    """``examples`` one a row, sorted by length, padded to the largest of ``buckets``."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), i))
    ordered = [examples[i] for i in order]
    longest = max(buckets)
    arrays, stats = pack_examples(ordered, longest, pad_id, packing=False)
    lengths = [len(e.ids) for e in ordered]
    edges = sorted(buckets)
    counts = [0] * len(edges)
    for n in lengths:
        counts[bisect.bisect_left(edges, n)] += 1
    return arrays, BucketStats(tuple(edges), tuple(counts), stats.tokens, stats.trained,
                               _quantiles(lengths), seq_len)  # fmt: skip


def row_lengths(segments: Array) -> Array:
    """The example length of each row (one example a row: its nonzero segment ids)."""
    return np.asarray((segments != 0).sum(axis=1), dtype=np.int64)


def fit_batch(batch: Sequence[Array], buckets: Sequence[int]) -> tuple[Array, ...]:
    """``batch`` (the ``PACKED_ARRAYS`` of one example a row) cut to the smallest bucket that
    holds its longest row."""
    used = int(row_lengths(batch[1]).max()) if len(batch[1]) else 0
    edges = sorted(buckets)
    width = edges[min(bisect.bisect_left(edges, used), len(edges) - 1)]
    return tuple(np.ascontiguousarray(a[:, :width]) for a in batch)


def epoch_order(
    segments: Array, buckets: Sequence[int], batch_size: int, seed: int, epoch: int
) -> Array:
    """The rows of an epoch, each batch of ``batch_size`` from one bucket (as many as
    fill), then the rows left over."""
    rng = np.random.default_rng([seed, epoch, 0xB0C])
    edges = sorted(buckets)
    which = np.searchsorted(edges, row_lengths(segments))
    batches: list[Array] = []
    left: list[Array] = []
    for b in range(len(edges)):
        rows = rng.permutation(np.flatnonzero(which == b))
        full = len(rows) // batch_size * batch_size
        batches += [rows[i : i + batch_size] for i in range(0, full, batch_size)]
        left.append(rows[full:])
    order = [batches[i] for i in rng.permutation(len(batches))] + left
    return np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64)


def compile_bucketed(
    compile_one: Callable[[Sequence[Any]], TrainStep],
    train: Sequence[Array],
    buckets: Sequence[int],
    batch_size: int,
) -> BucketedStep:
    """A step a bucket (``compile_one`` of a batch of its rows, cut to its length), all
    over the store of the largest (``BucketedStep.sharing``)."""
    edges = sorted(buckets)
    which = np.searchsorted(edges, row_lengths(train[1]))
    steps = []
    for b, width in enumerate(edges):
        rows = np.flatnonzero(which == b)[:batch_size]
        if len(rows) < batch_size:  # a bucket smaller than a batch: any rows, cut
            rows = np.arange(batch_size)
        steps.append(
            compile_one(
                tuple(torch.from_numpy(np.ascontiguousarray(a[rows, :width])) for a in train)
            )
        )
    return BucketedStep.sharing(steps, lambda batch: fit_batch(batch, edges))
