"""The clients' local loss under label skew: plain, or logit-adjusted.

A client whose shard holds two or three of the ten classes learns, from plain
cross-entropy, to push the absent classes' logits down; averaged over clients, those
pushes fight each other (client drift). The logit-adjusted loss (Menon et al. 2021,
"Long-tail learning via logit adjustment"; balanced softmax, Ren et al. 2020; FedLC's
calibration, Zhang et al. ICML 2022) trains on ``logits + tau * log p(y)``, where ``p``
is the client's own label distribution: a class the shard rarely shows already has a
low adjusted logit, so the client need not lower its real one. Evaluation and the global
model use the plain logits; nothing a client sends changes.

The prior is the shard's label frequencies with a pseudo-count of ``PSEUDO_COUNT`` per
class (Laplace smoothing), so an absent class has a finite log-prior. It enters the
compiled step as one more batch input, a ``[batch, classes]`` float32 array holding
``tau * log p`` in every row: one graph serves any prior, so a step is compiled once
per process and reused across rounds and, in the in-process driver, across clients.
With ``tau`` 0 the added input is zeros, and the step computes what the plain loss does
(``x + 0 == x`` in floats), bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pockengine.ir.arrays import Array

if TYPE_CHECKING:  # torch is imported where a loss runs: the options need only NumPy
    import torch
    from torch import nn

__all__ = [
    "LOCAL_LOSSES",
    "PSEUDO_COUNT",
    "adjusted_batch",
    "check_local_loss",
    "label_prior",
    "local_loss_fn",
    "logit_adjusted_loss",
    "logit_bias",
]
LOCAL_LOSSES = ("plain", "logit-adjusted")
PSEUDO_COUNT = 1.0  # per class: an absent class has prior 1 / (n + classes), not 0


def check_local_loss(local_loss: str, tau: float) -> str | None:
    """What is wrong with these options (a message naming the option), or None."""
    if local_loss not in LOCAL_LOSSES:
        return f"local_loss must be one of {', '.join(LOCAL_LOSSES)}, got {local_loss!r}"
    if not (math.isfinite(tau) and tau >= 0):
        return f"la_tau (the logit adjustment's weight) must be a finite number >= 0, got {tau}"
    return None


def label_prior(labels: Array, classes: int) -> Array:
    """The label distribution of ``labels`` (integers in ``[0, classes)``), smoothed by
    ``PSEUDO_COUNT`` per class; float64, sums to 1."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype}{labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"labels must lie in [0, {classes}), got {labels.min()}..{labels.max()}")
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    return (counts + PSEUDO_COUNT) / (len(labels) + PSEUDO_COUNT * classes)


def logit_bias(labels: Array, classes: int, tau: float) -> Array:
    """``tau * log p`` of the shard's smoothed prior: what the adjusted loss adds to
    every row of logits (float32, ``[classes]``)."""
    return np.asarray(tau * np.log(label_prior(labels, classes)), np.float32)


def adjusted_batch(batch: tuple[Array, ...], bias: Array) -> tuple[Array, ...]:
    """``batch`` (inputs..., labels) with the bias as a last ``[rows, classes]`` input."""
    rows = len(batch[-1])
    return (*batch, np.ascontiguousarray(np.broadcast_to(bias, (rows, len(bias)))))


def logit_adjusted_loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(*inputs) + bias`` against ``labels``, for a batch of
    ``inputs..., labels, bias`` (``bias``: ``[rows, classes]``, ``tau * log p``)."""
    import torch.nn.functional as F

    *inputs, labels, bias = batch
    return F.cross_entropy(model(*inputs) + bias, labels)


def local_loss_fn(
    local_loss: str, task_loss: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The loss a client compiles: the task's own, or the logit-adjusted one."""
    return logit_adjusted_loss if local_loss == "logit-adjusted" else task_loss
