"""Packing against pad-to-max for causal-LM fine-tuning on a long-tailed length distribution.

    OMP_NUM_THREADS=2 python benchmarks/lm_packing.py --examples 400 --seq-len 256 --steps 6

The examples are drawn with the seed: a prompt of lognormal length (median 40 tokens) and a
response of lognormal length (median 24), random token ids, cut to ``--seq-len`` as the
loader cuts them; the loss covers the responses. Both layouts compile the same step
(``lm_pack.packed_lm_loss``, a random LLaMA of ``--hidden`` x ``--layers``, the torch
backend, ``--batch-size`` rows of ``--seq-len``), one with the examples packed
(``pack_examples``), one with an example a row padded to ``--seq-len`` (``--packing off``).
Reported per layout: rows, the share of padded tokens, the median step time over
``--steps`` steps, and trained tokens a second (the trained tokens of an epoch over the
epoch's step time: rows / batch size x the median step). Writes
benchmarks/results/lm_packing.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from _harness import utc_now, write_results

import pockengine as pe
from pockengine.finetune.lm_data import LMExample
from pockengine.finetune.lm_pack import PackStats, pack_examples, packed_lm_loss


def _examples(n: int, seq_len: int, vocab: int, seed: int) -> list[LMExample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = max(1, round(rng.lognormal(np.log(40), 1.0)))
        response = max(1, round(rng.lognormal(np.log(24), 0.9)))
        length = min(prompt + response, seq_len)
        ids = rng.integers(1, vocab, length)
        trained = np.arange(length) >= prompt
        if not trained[1:].any():  # the loader drops one cut down to its prompt
            continue
        out.append(LMExample(ids, trained, f"synthetic:{i}"))
    return out


def _model(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _step(arrays: tuple[Any, ...], args: argparse.Namespace) -> Any:
    model = _model(args.vocab, args.hidden, args.layers)
    batch = tuple(torch.from_numpy(a[: args.batch_size].copy()) for a in arrays)
    return pe.compile(model, packed_lm_loss, batch, optimizer=pe.optim.AdamW(lr=1e-4),
                      backend="torch", compile_in="process")  # fmt: skip


def _timed(step: Any, arrays: tuple[Any, ...], rows: int, s: int, b: int) -> float:
    start = s * b % max(rows - b + 1, 1)
    batch = tuple(a[start : start + b].copy() for a in arrays)
    t = time.perf_counter()
    step(*batch)
    return time.perf_counter() - t


def _measure(layouts: dict[str, tuple[tuple[Any, ...], PackStats]],
             args: argparse.Namespace) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Step times of every layout, one step of each a round (a load spike hits all alike)."""
    steps = {name: _step(arrays, args) for name, (arrays, _) in layouts.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    b = args.batch_size
    for s in range(args.steps + 1):  # the first round warms the backend up
        for name, (arrays, stats) in layouts.items():
            times[name].append(_timed(steps[name], arrays, stats.rows, s, b))
    out = {}
    for name, (_, stats) in layouts.items():
        median = statistics.median(times[name][1:])
        epoch = stats.rows / b * median
        out[name] = {"rows": stats.rows, "padded_share": stats.padded_share, "step_s": median,
                     "trained_tokens": stats.trained,
                     "trained_tokens_per_s": stats.trained / epoch}  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    examples = _examples(args.examples, args.seq_len, args.vocab, args.seed)
    layouts = {name: pack_examples(examples, args.seq_len, 0, packing=packing)
               for name, packing in (("packed", True), ("pad-to-max", False))}  # fmt: skip
    for name, (_, stats) in layouts.items():
        print(stats.describe(name))
    results = _measure(layouts, args)
    lo, med, p90, p99, hi = stats.lengths
    speedup = (
        results["packed"]["trained_tokens_per_s"] / results["pad-to-max"]["trained_tokens_per_s"]
    )
    print(f"lengths min/median/p90/p99/max: {lo}/{med}/{p90}/{p99}/{hi}")
    for name, r in results.items():
        print(f"{name:>11}: {r['rows']} rows, {r['padded_share']:.1%} padding, step "
              f"{r['step_s'] * 1000:.0f} ms, {r['trained_tokens_per_s']:.0f} trained "
              "tokens/s")  # fmt: skip
    print(f"packing: {speedup:.2f}x the trained tokens a second of pad-to-max")
    write_results("lm_packing", {"when": utc_now(), "args": vars(args),
                                      "lengths": list(stats.lengths), "speedup": speedup,
                                      **results})  # fmt: skip


if __name__ == "__main__":
    main()
