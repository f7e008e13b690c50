"""``pockengine evaluate`` of a run that trained a causal LM on packed examples (``lm_task``):
the mean loss and perplexity over the trained tokens of its validation split or of a data
file read as the run read its own (kind, ``--train-on-prompt``, truncation, ``--seq-len``),
packed the same way and run eagerly with the same attention mask (``lm_pack``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.tasks import lm_data, lm_pack

__all__ = ["file_arrays", "is_packed_run", "packed_perplexity"]


def is_packed_run(meta: dict[str, Any]) -> bool:
    """Whether ``RUN/model/pockengine.json`` says the run trained on packed examples."""
    return meta.get("task") == "causal-lm" and bool(meta.get("packed"))


def file_arrays(tokenizer: Any, meta: dict[str, Any], path: Path) -> tuple[Array, ...]:
    """The packed arrays of ``path``, read and tokenised as the run read its data."""
    config = meta.get("config", {})
    seq_len = int(meta["seq_len"])
    data = lm_data.load_lm_data(
        path,
        tokenizer,
        seq_len,
        kind=config.get("data_format"),
        train_on_prompt=bool(config.get("train_on_prompt", False)),
        truncate=bool(config.get("truncate", True)),
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packing = config.get("packing", "on") == "on"
    arrays, _ = lm_pack.pack_examples(data.examples, seq_len, int(pad or 0), packing=packing)
    return arrays


def packed_perplexity(
    model: nn.Module, arrays: tuple[Array, ...], batch: int = 8
) -> dict[str, Any]:
    """Mean loss and perplexity over the trained targets of packed rows."""
    total, tokens = 0.0, 0
    rows = len(arrays[0])
    with torch.no_grad():
        for start in range(0, rows, batch):
            ids, seg, pos, targets, weights = (
                torch.from_numpy(np.ascontiguousarray(a[start : start + batch])) for a in arrays
            )
            out = lm_pack.packed_lm_eval(
                model, ids, seg, pos, targets, weights, torch.ones(len(ids))
            )
            total, tokens = total + float(out[0]), tokens + round(float(out[1]))
    mean = total / max(tokens, 1)
    return {
        "chunks": rows,
        "tokens": tokens,
        "loss": mean,
        "perplexity": math.exp(min(mean, 700.0)),
    }
