"""Validation metrics of a task (the run's log of them is ``finetune.run_folder.metrics_log``).

Evaluation runs through the compiled forward (``compile_evaluator``: the step's own
backend and values, no float copy of the model, the chunked vocabulary loss): one graph
compiled per run at the validation batch size (64 examples; 8 sequences for a causal LM),
whose result per batch is the summed loss (and, for a classifier, the count of correct
predictions), each example weighted by a row weight, so the last, short batch is padded
with copies of its first row at weight 0. Where the frontend cannot give that graph (ONNX,
JAX and Keras models; a model whose evaluation updates buffers) ``evaluate`` copies the
step's values into the torch model (``step.load_into``) and runs it in eval mode under
``torch.no_grad()``. Classification reports accuracy and mean cross-entropy; a causal LM
reports the mean token loss and its perplexity.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pockengine.ir import CompileError
from pockengine.ir.arrays import Array
from pockengine.step.compiler import TrainStep
from pockengine.step.evaluator import Evaluator
from pockengine.step.running import CompiledStep
from pockengine.tasks.config import FinetuneError
from pockengine.tasks.recipes import Task, tensor_rows

__all__ = [
    "causal_lm_eval",
    "classification_eval",
    "compile_evaluator",
    "evaluate",
]

log = logging.getLogger(__name__)
CLASSIFY_BATCH = 64
CAUSAL_LM_BATCH = 8  # sequences: the logits are as wide as the vocabulary


def classification_eval(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """``[sum of w * cross-entropy, sum of w * correct]`` over a batch of ``inputs...,
    labels, w``. Correct: the label is the first largest logit (``torch.argmax``'s rule)."""
    *inputs, labels, weights = batch
    logits = model(*inputs)
    logp = F.log_softmax(logits, dim=-1)
    target = labels.unsqueeze(-1)
    loss = -logp.gather(-1, target).squeeze(-1)
    is_max = (logits == logits.amax(dim=-1, keepdim=True)).to(logits.dtype)
    first_max = is_max * (is_max.cumsum(dim=-1) == 1).to(logits.dtype)
    correct = first_max.gather(-1, target).squeeze(-1)
    return torch.stack([(loss * weights).sum(), (correct * weights).sum()])


def causal_lm_eval(model: nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[sum of w * next-token loss]`` over a batch of ``[rows, seq]`` token ids (every
    next token a target) with row weights ``w``."""
    logits = model(input_ids=ids, use_cache=False).logits
    rows, vocab = ids.shape[0], logits.shape[-1]
    logp = F.log_softmax(logits[:, :-1].reshape(-1, vocab), dim=-1)
    picked = logp.gather(-1, ids[:, 1:].reshape(-1, 1)).reshape(rows, -1)
    return torch.stack([-(picked.sum(dim=-1) * weights).sum()])


def compile_evaluator(step: TrainStep, task: Task) -> Evaluator | None:
    """The task's evaluation compiled on ``step`` at the validation batch size (at most
    the split's size), or None (logged) where it cannot be: ``evaluate`` then runs the
    torch model eagerly."""
    lm = task.kind == "causal-lm"
    size = min(CAUSAL_LM_BATCH if lm else CLASSIFY_BATCH, max(task.val_size, 1))
    example = tuple(torch.from_numpy(a) for a in _padded(task.val, 0, size))
    eval_fn: Callable[..., torch.Tensor] = causal_lm_eval if lm else classification_eval
    if _packed(task):
        from pockengine.tasks.lm_pack import packed_lm_eval

        eval_fn = packed_lm_eval
    try:
        return step.evaluator(task.model, eval_fn, example)
    except CompileError as exc:
        log.warning("validation runs the torch model eagerly: no compiled evaluation (%s)", exc)
        return None


def evaluate(
    step: CompiledStep,
    task: Task,
    batch_size: int = CLASSIFY_BATCH,
    evaluator: Evaluator | None = None,
) -> dict[str, float]:
    """Validation metrics of the step's current weights: through ``evaluator`` (from
    ``compile_evaluator``) when given, else in eager torch (in batches of ``batch_size``;
    a causal LM in batches of at most 8 sequences)."""
    if evaluator is not None:
        return _compiled(evaluator, task)
    # Buffers the compiled step does not hold (ones the loss never reads) keep their values.
    loaded = step.load_into(task.model, strict=False)
    if loaded.unexpected or loaded.mismatched:
        raise FinetuneError(f"the trained values do not fit the model: {loaded.describe()}")
    was_training = task.model.training
    task.model.eval()
    try:
        with torch.no_grad():
            if task.kind == "causal-lm":
                return _causal_lm(task, min(batch_size, CAUSAL_LM_BATCH))
            return _classification(task, batch_size)
    finally:
        task.model.train(was_training)


def _padded(split: tuple[Array, ...], start: int, size: int) -> tuple[Array, ...]:
    """Rows ``start:start+size`` of every array, the missing ones copies of the first row,
    and the row weights (1, padding 0) last."""
    rows = [a[start : start + size] for a in split]
    real = len(rows[0])
    if real < size:
        rows = [np.concatenate([r, np.repeat(r[:1], size - real, axis=0)]) for r in rows]
    weights = (np.arange(size) < real).astype(np.float32)
    return (*(np.ascontiguousarray(r) for r in rows), weights)


def _batches(evaluator: Evaluator, split: tuple[Array, ...]) -> Iterator[Array]:
    size = evaluator.batch_size
    for start in range(0, len(split[0]), size):
        yield evaluator(*_padded(split, start, size))


def _compiled(evaluator: Evaluator, task: Task) -> dict[str, float]:
    n = task.val_size
    if n == 0:
        raise FinetuneError("the validation split is empty")
    sums = np.zeros(1 if task.kind == "causal-lm" and not _packed(task) else 2)
    for out in _batches(evaluator, task.val):
        sums += out
    if task.kind == "causal-lm":
        # packed rows: the trained targets the evaluation counted; chunks: all but the first
        tokens = sums[1] if _packed(task) else n * (task.val[0].shape[1] - 1)
        mean = float(sums[0]) / max(float(tokens), 1.0)
        return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}
    return {"val_loss": float(sums[0]) / n, "val_accuracy": round(float(sums[1])) / n}


def _packed(task: Task) -> bool:
    """Whether the task's arrays are packed causal-LM rows (``lm_pack``), not chunks."""
    from pockengine.tasks.lm_pack import PACKED_ARRAYS

    return task.kind == "causal-lm" and len(task.val) == len(PACKED_ARRAYS)


def _classification(task: Task, batch_size: int) -> dict[str, float]:
    total_loss, correct = 0.0, 0
    n = task.val_size
    for start in range(0, n, batch_size):
        *inputs, labels = tensor_rows(task.val, start, start + batch_size)
        logits = task.model(*inputs)
        total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(-1) == labels).sum())
    return {"val_loss": total_loss / n, "val_accuracy": correct / n}


def _causal_lm(task: Task, batch_size: int) -> dict[str, float]:
    """Validation chunks hold no padding: every next token is a target (packed rows: the
    trained targets)."""
    total_loss, tokens = 0.0, 0
    if _packed(task):
        from pockengine.tasks.lm_pack import packed_lm_eval

        for start in range(0, task.val_size, batch_size):
            ids, seg, pos, targets, weights = tensor_rows(task.val, start, start + batch_size)
            rows = torch.ones(len(ids))
            out = packed_lm_eval(task.model, ids, seg, pos, targets, weights, rows)
            total_loss, tokens = total_loss + float(out[0]), tokens + round(float(out[1]))
        mean = total_loss / max(tokens, 1)
        return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}
    for start in range(0, task.val_size, batch_size):
        ids = torch.from_numpy(task.val[0][start : start + batch_size])
        logits = task.model(input_ids=ids, use_cache=False).logits[:, :-1]
        targets = ids[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum")
        total_loss += float(loss)
        tokens += int(targets.numel())
    mean = total_loss / max(tokens, 1)
    return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}
