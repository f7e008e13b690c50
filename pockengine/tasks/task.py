"""``Task``: what a recipe builds for a run, the model, its loss and the data it trains on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.tasks import data as ds
from pockengine.tasks import lm_buckets

__all__ = ["Task"]


@dataclass
class Task:
    """A model, its loss and the data it trains on (batch arrays: inputs..., labels)."""

    name: str
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    train: tuple[Array, ...]
    val: tuple[Array, ...]
    labels: tuple[str, ...]
    kind: str = "classify"
    notes: list[str] = field(default_factory=list)
    inputs: str = ""  # what one example is, for the summary: "128 tokens"
    test: tuple[Array, ...] = ()  # held out from everything but the final test metric
    tokenizer: Any = None  # what encodes a text (a transformers tokenizer, a WordTokenizer)
    home: dict[str, Any] = field(default_factory=dict)  # how RUN/model is written (home.py)
    # where ``train`` is part of the training split (``for_analysis``): the whole split's
    # fingerprint and size
    train_digest: str = ""
    train_count: int = 0
    # causal LM, --packing off: the row lengths of the length buckets (``lm_buckets``)
    buckets: tuple[int, ...] = ()

    @property
    def train_size(self) -> int:
        return self.train_count or len(self.train[0])

    def train_fingerprint(self) -> str:
        """``data.fingerprint`` of the whole training split (the caches' key)."""
        return self.train_digest or ds.fingerprint(*self.train)

    def holding(self, first: int, last: int = 0, val: int = 0) -> Task:
        """A copy whose training split holds only its first ``first`` and last ``last``
        examples (in that order; all of it where they would overlap), its validation split
        its first ``val``, its test split none, but with the whole training split's
        fingerprint and size. A helper process that needs a few batches drops the rest
        before its work (lite0-fashion's training images are 98 MiB at 64 px)."""
        keep = self.train
        if self.train_size > first + last:
            keep = tuple(np.concatenate([a[:first], a[len(a) - last :]]) for a in self.train)
        return dataclasses.replace(
            self,
            train=keep,
            val=tuple(a[:val] for a in self.val),
            test=tuple(a[:0] for a in self.test),
            train_digest=self.train_fingerprint(),
            train_count=self.train_size,
        )

    def for_analysis(self, batch_size: int, batches: int, val: int = 0) -> Task:
        """What ``--scheme auto``'s analysis reads of the data (``holding``): the first
        batch (what the model is imported on) and the last ``batches`` batches (whose
        gradients are estimated: ``estimate.estimate_scores`` counts them from the end;
        ``EstimateSettings.batches``), and the first ``val`` validation examples."""
        last = min(batches, self.train_size // batch_size) * batch_size
        return self.holding(batch_size, last, val)

    def epoch_order(self, seed: int, epoch: int, batch_size: int) -> Array:
        """The training rows in the order epoch ``epoch`` reads them: shuffled with the
        seed, or with length buckets each batch from one bucket (``lm_buckets``)."""
        if not self.buckets:
            return ds.epoch_order(self.train_size, seed, epoch)
        return lm_buckets.epoch_order(self.train[1], self.buckets, batch_size, seed, epoch)

    @property
    def val_size(self) -> int:
        return len(self.val[0])
