"""Length buckets for ``--packing off``: the bucket choice, one store of state for all the
buckets' compiled steps, the per-bucket batches, and the loss they compute."""

from __future__ import annotations

import bisect
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.cli import main
from pockengine.step.bucketed import BucketedStep
from pockengine.step.running import BatchError
from pockengine.tasks import lm_buckets, lm_pack
from pockengine.tasks.lm_data import LMExample
from tests.lm_folders import make_lm_folder

VOCAB = 64


def _brute_force(lengths: list[int], k: int, min_count: int) -> int | None:
    """The least padding over every choice of at most ``k`` buckets."""
    distinct = sorted(set(lengths))
    best = None
    for n in range(1, k + 1):
        for inner in itertools.combinations(distinct[:-1], n - 1):
            edges = [*inner, distinct[-1]]
            counts = [0] * len(edges)
            for x in lengths:
                counts[bisect.bisect_left(edges, x)] += 1
            if min(counts) >= min_count:
                pad = lm_buckets.padded_tokens(lengths, edges)
                best = pad if best is None else min(best, pad)
    return best


def test_buckets_pad_least() -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        lengths = [int(x) for x in rng.integers(1, 40, rng.integers(1, 20))]
        k, min_count = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        buckets = lm_buckets.choose_buckets(lengths, k, min_count)
        assert buckets[-1] == max(lengths) and len(buckets) <= k
        best = _brute_force(lengths, k, min_count)
        if best is None:  # too few examples to fill two buckets: one
            assert buckets == (max(lengths),)
        else:
            assert lm_buckets.padded_tokens(lengths, buckets) == best


def test_enough_padding_takes_the_fewest_buckets_that_reach_it() -> None:
    """With a padded share to reach, the fewest buckets whose least padding is within it
    (each bucket is one more compiled step); the least padding when no count reaches it."""
    rng = np.random.default_rng(1)
    for _ in range(100):
        lengths = [int(x) for x in rng.integers(1, 60, rng.integers(2, 24))]
        k, min_count, enough = int(rng.integers(1, 6)), int(rng.integers(1, 3)), 0.15
        buckets = lm_buckets.choose_buckets(lengths, k, min_count, enough)
        pad = lm_buckets.padded_tokens(lengths, buckets)
        least = {n: _brute_force(lengths, n, min_count) for n in range(1, k + 1)}
        within = [n for n, p in least.items() if p is not None and p <= enough * (sum(lengths) + p)]
        if within:
            assert len(buckets) == min(within) and pad <= enough * (sum(lengths) + pad)
        elif least[k] is not None:
            assert pad == least[k]
    # a long tail: ten lengths, each its own bucket pads nothing, but two reach 15%
    lengths = [10] * 40 + [12] * 30 + list(range(100, 108))
    assert len(lm_buckets.choose_buckets(lengths, 10, 1)) == 10
    assert lm_buckets.choose_buckets(lengths, 10, 1, 0.15) == (12, 107)


def _examples(n: int, seed: int = 0) -> list[LMExample]:
    """A long-tailed mix: many short examples, a few long; the first 3 tokens a prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(min(48, 5 + rng.lognormal(np.log(8), 0.8)))
        ids = rng.integers(1, VOCAB, length)
        out.append(LMExample(ids, np.arange(length) >= 3, f"x:{i}"))
    return out


def _model() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _bucketed(
    model: torch.nn.Module, arrays: tuple[Any, ...], buckets: tuple[int, ...], batch: int,
    optimizer: Any,
) -> BucketedStep:  # fmt: skip
    def one(example: Any) -> Any:
        return pe.compile(model, lm_pack.packed_lm_loss, example, optimizer=optimizer,
                          backend="torch", compile_in="process")  # fmt: skip

    return lm_buckets.compile_bucketed(one, arrays, buckets, batch)


def test_bucket_steps_share_one_store() -> None:
    """Each bucket's step runs on the largest's store: an update through the short bucket
    is what the long one reads, and AdamW has one state (its moments and step count), so
    two steps through two buckets equal the same two steps of one pad-to-max step."""
    examples = _examples(40)
    buckets = lm_buckets.choose_buckets([len(e.ids) for e in examples], 3, 4)
    assert len(buckets) == 3
    arrays, stats = lm_buckets.bucket_examples(examples, buckets, 0, 48)
    assert stats.padded_share < stats.pad_to_max_share
    adamw = pe.optim.AdamW(lr=1e-2)
    step = _bucketed(_model(), arrays, buckets, 4, adamw)
    assert len(step.shapes) == 3
    short, long = arrays_at(arrays, range(0, 4)), arrays_at(arrays, range(36, 40))
    assert step.step_for(short)[0] is not step.step_for(long)[0]
    for other in step._by_shape.values():
        assert other._store is step._store  # one dict of tensors, not copies
    example = tuple(torch.from_numpy(a) for a in short)
    reference = pe.compile(_model(), lm_pack.packed_lm_loss, example, optimizer=adamw,
                           backend="torch", compile_in="process")  # fmt: skip
    before = step.flat_state_dict()
    losses = [step(*short), step(*long)]
    expected = [reference(*short), reference(*long)]  # one shape: short padded to the longest
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    after, ref = step.flat_state_dict(), reference.flat_state_dict()
    assert any(not np.array_equal(before[n], after[n]) for n in after)
    # AdamW moves a weight by about lr (1e-2) a step whatever its gradient's size, so the
    # padded step's other summation order can move one by a few 1e-5 (seen: 5e-5, with
    # transformers 5.25); a step through the wrong store would differ by about 1e-2
    for name in after:
        np.testing.assert_allclose(after[name], ref[name], rtol=1e-4, atol=2e-4)
    state, ref_state = step.optimizer_state(), reference.optimizer_state()
    assert state.keys() == ref_state.keys()
    for name in state:
        np.testing.assert_allclose(state[name], ref_state[name], rtol=1e-4, atol=1e-7)
    with pytest.raises(BatchError, match="none of the compiled ones"):
        step(*(a[:3] for a in long))


def arrays_at(arrays: tuple[Any, ...], rows: range) -> tuple[Any, ...]:
    return tuple(np.ascontiguousarray(a[list(rows)]) for a in arrays)


def test_bucketed_loss_and_gradients_equal_examples_one_by_one() -> None:
    """A batch run through its bucket's step: loss and gradients = the examples one by one
    in eager torch, labels -100 on the prompt, summed over the batch's trained tokens."""
    examples = _examples(24, seed=1)
    buckets = lm_buckets.choose_buckets([len(e.ids) for e in examples], 3, 4)
    arrays, _ = lm_buckets.bucket_examples(examples, buckets, 0, 48)
    model = _model()
    step = _bucketed(model, arrays, buckets, 4, pe.optim.SGD(lr=0.1))
    ordered = sorted(examples, key=lambda e: len(e.ids))
    for rows in (range(0, 4), range(10, 14)):
        batch = arrays_at(arrays, rows)
        width = step.step_for(batch)[1][0].shape[1]
        assert width == min(b for b in buckets if b >= max(len(ordered[r].ids) for r in rows))
        grads = step.gradients(*batch)
        total, trained = torch.zeros(()), 0
        model.zero_grad()
        for r in rows:
            ex = ordered[r]
            ids = torch.from_numpy(ex.ids)[None]
            labels = torch.where(torch.from_numpy(ex.trained), ids[0], -100)[None]
            n = int(ex.trained[1:].sum())
            total = total + model(input_ids=ids, labels=labels, use_cache=False).loss * n
            trained += n
        (total / trained).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-6)
        with torch.no_grad():
            padded = lm_pack.packed_lm_loss(model, *(torch.from_numpy(a) for a in batch))
        assert float(padded) == pytest.approx(float(total.detach()) / trained, rel=1e-5)


def test_epoch_order_draws_each_batch_from_one_bucket() -> None:
    examples = _examples(50, seed=2)
    buckets = lm_buckets.choose_buckets([len(e.ids) for e in examples], 4, 4)
    arrays, stats = lm_buckets.bucket_examples(examples, buckets, 0, 48)
    which = np.searchsorted(buckets, lm_buckets.row_lengths(arrays[1]))
    order = lm_buckets.epoch_order(arrays[1], buckets, 4, 0, 0)
    assert sorted(order) == list(range(len(examples)))
    full = sum(c // 4 for c in stats.counts)
    for b in range(full):
        assert len(set(which[order[b * 4 : (b + 1) * 4]])) == 1
    assert not np.array_equal(order, lm_buckets.epoch_order(arrays[1], buckets, 4, 0, 1))


def test_finetune_packing_off_reports_buckets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_lm_folder(tmp_path / "tiny")
    records = [{"prompt": "how do I sort?" * (1 + i % 5), "completion": "use sorted" * (1 + i % 3)}
               for i in range(24)]  # fmt: skip
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    args = ["finetune", "--model", str(folder), "--data", str(data), "--seq-len", "96",
            "--batch-size", "2", "--epochs", "1", "--scheme", "sparse", "--out", str(out),
            "--progress", "none", "--packing", "off", "--buckets", "3"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "in 3 length buckets" in printed and "(padded to 96:" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] > 0 and summary["final"]["val_perplexity"] > 1
