"""BatchNorm statistics for a federated model: recomputed on each client, pooled exactly.

A train-mode BatchNorm layer normalises with the batch's statistics and keeps running
ones for evaluation, updated by ``momentum`` a step. With few local steps a round (a
shard of 200 images is 12 steps of 16) and a small momentum (EfficientNet's 0.01), the
running statistics that clients send back are still mostly those the pretrained model
started with: the server then evaluates weights trained under one normalisation with
another one (docs/federated.md, lite0-fashion). So, with
``bn_statistics="recompute"``, a client computes after its local epochs the statistics
of its whole shard under its final weights (one forward pass in train mode, no update;
the layers the step runs on running statistics, a scheme's frozen ones under
``frozen_bn="eval"``, stay on them), and sends those. ``pool`` then merges the
clients' statistics as those of the pooled data: the weighted mean of the means, and
the weighted mean of the variances plus the spread of the clients' means around it
(without it, label-skewed clients, whose means differ, would give the pooled data too
small a variance).

The layers are found by type on the task's torch module (``nn.modules.batchnorm``), so
their buffers are named as the step names them (``layer.running_mean``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.step.compiler import TrainStep
from pockengine.step.parts import eval_batchnorms

__all__ = ["BatchNormStats"]


@dataclass(frozen=True)
class BatchNormStats:
    """The BatchNorm layers of a model whose statistics travel: variance name -> mean name."""

    pairs: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module, sent: Sequence[str]) -> BatchNormStats:
        """The layers of ``model`` whose running mean and variance are both in ``sent``."""
        pairs = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                mean, var = f"{name}.running_mean", f"{name}.running_var"
                if mean in sent and var in sent:
                    pairs[var] = mean
        return cls(pairs)

    def recompute(
        self, step: TrainStep, model: nn.Module, inputs: Sequence[Array], batch_size: int
    ) -> dict[str, Array]:
        """The statistics of ``inputs`` (a shard's model inputs) under ``step``'s weights:
        for each layer, the mean over the batches of the batch means and (unbiased)
        variances, as train mode computes them. ``model`` is left as it was."""
        import torch

        from pockengine.tasks.recipes import tensor_rows

        layers = {n: m for n, m in model.named_modules() if f"{n}.running_var" in self.pairs}
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        momenta = {n: m.momentum for n, m in layers.items()}
        was_training = model.training
        try:
            step.load_into(model, strict=False)
            for layer in layers.values():
                layer.reset_running_stats()
                layer.momentum = None  # a cumulative mean over the batches
            model.train()
            for name in _eval_modules(step):  # as the step runs them: running statistics
                model.get_submodule(name).eval()
            with torch.no_grad():
                for start in range(0, len(inputs[0]) - batch_size + 1, batch_size):
                    model(*tensor_rows(inputs, start, start + batch_size))
            out = {}
            for name, layer in layers.items():
                assert layer.running_mean is not None and layer.running_var is not None
                out[f"{name}.running_mean"] = layer.running_mean.numpy().copy()
                out[f"{name}.running_var"] = layer.running_var.numpy().copy()
            return out
        finally:
            for name, layer in layers.items():
                layer.momentum = momenta[name]
            model.load_state_dict(saved)
            model.train(was_training)

    def pool(
        self,
        average: dict[str, Array],
        replies: Sequence[Mapping[str, Array]],
        weights: Sequence[float],
    ) -> dict[str, Array]:
        """``average`` (the weighted mean of ``replies``) with each variance widened by
        the weighted spread of the clients' means: the variance of the pooled data."""
        total = float(sum(weights))
        out = dict(average)
        for var, mean in self.pairs.items():
            spread = sum(
                w * np.square(r[mean].astype(np.float64) - average[mean])
                for w, r in zip(weights, replies, strict=True)
            )
            out[var] = (average[var] + spread / total).astype(average[var].dtype)
        return out


def _eval_modules(step: TrainStep) -> set[str]:
    """The BatchNorm layers ``step`` runs on their running statistics (``eval_batchnorms``):
    in a train-mode pass they would normalise by the batch instead, and the layers after
    them would see other inputs than in training."""
    return eval_batchnorms(step.info, step.resolution)
