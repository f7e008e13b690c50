"""The ``smollm2-pyqa`` recipe: SmolLM2-135M-Instruct instruction-tuned on question/answer
pairs derived from the Python documentation (``instruct_data``).

Each pair is a ``completion`` example (``lm_data``): the question a user turn, the answer
the assistant turn, rendered with the model's chat template, the loss on the answer's
tokens only. The splits are ``instruct_data.split_pairs``' (by a hash of the name, the
same for every run): training (shuffled with the seed, at most ``--max-train`` pairs),
validation (at most ``--max-val``, what the best epoch and any choice reads) and the
held-out test split (its first ``TEST_PAIRS``), read only for the final test metric.
Each split is packed into ``--seq-len`` rows (``lm_pack``; ``--packing off``: length
buckets, ``lm_buckets``) as the ``generic-lm`` recipe packs the user's data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.tasks import instruct_data, lm_buckets, lm_data, lm_pack
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.task import Task

__all__ = ["TEST_PAIRS", "build_pyqa_task", "pyqa_examples", "pyqa_task"]

TEST_PAIRS = 128  # the held-out pairs the test metric reads (the split's first, fixed)


def build_pyqa_task(config: FinetuneConfig) -> Task:
    """The recipe's task on the installed docs and SmolLM2-135M-Instruct."""
    from pockengine.tasks import causal_lm

    files = causal_lm.pydocs_files()
    model, tokenizer = causal_lm.load_smollm2(config)
    return pyqa_task(config, files, model, tokenizer)


def pyqa_examples(
    files: Sequence[Path], tokenizer: Any, config: FinetuneConfig
) -> tuple[list[list[lm_data.LMExample]], list[str]]:
    """The train, validation and test examples of the pairs in ``files``, and notes."""
    assert config.seq_len is not None
    pairs = instruct_data.pydocs_pairs(files)
    train_p, val_p, test_p = instruct_data.split_pairs(pairs)
    order = np.random.default_rng([config.seed, 0x9A]).permutation(len(train_p))
    chosen = ([train_p[i] for i in order][: config.max_train], val_p[: config.max_val],
              test_p[:TEST_PAIRS])  # fmt: skip
    if not all(chosen):
        raise FinetuneError(
            f"{len(pairs)} question/answer pairs in {len(files)} files: too "
            "few for a training, validation and test split"
        )
    notes = [f"{len(pairs)} question/answer pairs from the library reference: "
             f"{len(train_p)} train / {len(val_p)} validation / {len(test_p)} held-out test "
             f"(by name); using {' / '.join(str(len(c)) for c in chosen)}"]  # fmt: skip
    splits = []
    for what, part in zip(("train", "validation", "test"), chosen, strict=True):
        data = lm_data.records_data(
            ((p.where, p.record) for p in part),
            "completion",
            tokenizer,
            config.seq_len,
            f"pyqa {what}",
            train_on_prompt=config.train_on_prompt,
        )
        if data.truncated:
            notes.append(
                f"{what}: {data.truncated} pairs longer than {config.seq_len} tokens "
                f"cut ({data.dropped} dropped)"
            )
        splits.append(data.examples)
    return splits, notes


def pyqa_task(
    config: FinetuneConfig, files: Sequence[Path], model: nn.Module, tokenizer: Any
) -> Task:
    """The recipe's task on ``files`` (the docs' ``*.rst.txt``) for ``model``."""
    assert config.seq_len is not None and config.batch_size is not None
    (train_ex, val_ex, test_ex), notes = pyqa_examples(files, tokenizer, config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad, seq = int(pad or 0), config.seq_len
    buckets: tuple[int, ...] = ()
    train_stats: lm_pack.PackStats | lm_buckets.BucketStats
    if config.packing == "on":
        train, train_stats = lm_pack.pack_examples(train_ex, seq, pad)
    else:
        buckets = lm_buckets.choose_buckets(
            [len(e.ids) for e in train_ex],
            config.buckets,
            config.batch_size,
            lm_buckets.ENOUGH_PADDING,
        )
        train, train_stats = lm_buckets.bucket_examples(train_ex, buckets, pad, seq)
    packing = config.packing == "on"
    val, val_stats = lm_pack.pack_examples(val_ex, seq, pad, packing=packing)
    test, test_stats = lm_pack.pack_examples(test_ex, seq, pad, packing=packing)
    if train_stats.rows < config.batch_size:
        raise FinetuneError(
            f"the training split packs into {train_stats.rows} rows, fewer "
            f"than one batch of {config.batch_size}"
        )
    notes += [
        train_stats.describe("train"),
        val_stats.describe("validation"),
        test_stats.describe("test"),
    ]
    torch.manual_seed(config.seed)
    return Task(
        "smollm2-pyqa",
        model,
        lm_pack.packed_lm_loss,
        train,
        val,
        (),
        kind="causal-lm",
        notes=notes,
        inputs=f"{seq} tokens",
        test=test,
        tokenizer=tokenizer,
        home={"format": "hf-causal-lm", "packed": True},
        buckets=buckets,
    )
