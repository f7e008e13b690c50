"""Packing against pad-to-max for causal-LM fine-tuning on a long-tailed length distribution.

    OMP_NUM_THREADS=1 python benchmarks/lm_packing.py --examples 400 --seq-len 256 --steps 6

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

The step time is the CPU time of the process during the step (``time.process_time``), with
the wall-clock median beside it: on a machine shared with other work, the wall clock of a
step counts the time it waited for a core, which differs from step to step and layout to
layout by more than the layouts differ; with one thread the CPU time is the step's own
work. Both layouts compile the same graph (same shapes, the mask built inside the step from
the segment ids and positions), which the run checks and records as ``same_graph``.

A third layout, ``buckets`` (``--packing off`` as the fine-tuner runs it): at most
``--buckets`` row lengths, the fewest that pad at most 8% (``lm_buckets.choose_buckets``,
each bucket holding a batch), one compiled step a bucket over one store (``BucketedStep``),
an epoch's batches drawn per bucket (``lm_buckets.epoch_order``). Its step time is measured
per bucket (the median over ``--steps`` steps of each, in the same rounds as the other
layouts), its epoch time is the sum over the epoch's batches of their bucket's step time,
and its padded share is counted over the tokens those batches process (the rows left over
from each bucket's last partial batch ride in wider batches, which this counts).
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
from pockengine.tasks import lm_buckets
from pockengine.tasks.lm_data import LMExample
from pockengine.tasks.lm_pack import PackStats, pack_examples, packed_lm_loss


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


def _timed(step: Any, arrays: tuple[Any, ...], rows: int, s: int, b: int) -> tuple[float, float]:
    """CPU and wall-clock seconds of one step on the ``s``-th batch."""
    start = s * b % max(rows - b + 1, 1)
    batch = tuple(a[start : start + b].copy() for a in arrays)
    cpu, wall = time.process_time(), time.perf_counter()
    step(*batch)
    return time.process_time() - cpu, time.perf_counter() - wall


class _Buckets:
    """The bucketed layout: its arrays, stats, one-store step and an epoch's batches."""

    def __init__(self, examples: list[LMExample], args: argparse.Namespace) -> None:
        b = args.batch_size
        lengths = [len(e.ids) for e in examples]
        self.edges = lm_buckets.choose_buckets(lengths, args.buckets, b, lm_buckets.ENOUGH_PADDING)
        self.arrays, self.stats = lm_buckets.bucket_examples(examples, self.edges, 0,
                                                             args.seq_len)  # fmt: skip
        order = lm_buckets.epoch_order(self.arrays[1], self.edges, b, args.seed, 0)
        self.batches = [order[i : i + b] for i in range(0, len(order) - b + 1, b)]
        self.widths = [self._fitted(rows)[0].shape[1] for rows in self.batches]
        model = _model(args.vocab, args.hidden, args.layers)

        def one(batch: Any) -> Any:
            return pe.compile(model, packed_lm_loss, batch, optimizer=pe.optim.AdamW(lr=1e-4),
                              backend="torch", compile_in="process")  # fmt: skip

        self.step = lm_buckets.compile_bucketed(one, self.arrays, self.edges, b)
        self.times: dict[int, list[tuple[float, float]]] = {w: [] for w in self.edges}

    def _fitted(self, rows: Any) -> tuple[Any, ...]:
        return lm_buckets.fit_batch([a[rows] for a in self.arrays], self.edges)

    def time_round(self, s: int) -> None:
        """One step of every bucket (its ``s``-th batch)."""
        for width in self.edges:
            mine = [rows for rows, w in zip(self.batches, self.widths, strict=True) if w == width]
            if not mine:
                continue
            batch = self._fitted(mine[s % len(mine)])
            cpu, wall = time.process_time(), time.perf_counter()
            self.step(*batch)
            self.times[width].append((time.process_time() - cpu, time.perf_counter() - wall))

    def result(self) -> dict[str, Any]:
        cpu = {w: statistics.median(t[0] for t in ts[1:]) for w, ts in self.times.items() if ts}
        wall = {w: statistics.median(t[1] for t in ts[1:]) for w, ts in self.times.items() if ts}
        tokens = sum(int(self.arrays[1][rows].astype(bool).sum()) for rows in self.batches)
        slots = sum(len(rows) * w for rows, w in zip(self.batches, self.widths, strict=True))
        trained = sum(int(self.arrays[4][rows].sum()) for rows in self.batches)
        epoch_cpu = sum(cpu[w] for w in self.widths)
        epoch_wall = sum(wall[w] for w in self.widths)
        n = len(self.widths)
        return {"rows": self.stats.rows, "buckets": list(self.edges),
                "bucket_rows": list(self.stats.counts),
                "padded_share": 1 - tokens / slots, "layout_padded_share": self.stats.padded_share,
                "step_s_by_bucket": {str(w): t for w, t in cpu.items()},
                "step_s": epoch_cpu / n, "wall_step_s": epoch_wall / n,
                "trained_tokens": trained, "trained_tokens_per_s": trained / epoch_cpu,
                "wall_trained_tokens_per_s": trained / epoch_wall}  # fmt: skip


def _measure(layouts: dict[str, tuple[tuple[Any, ...], PackStats]], buckets: _Buckets,
             args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], bool]:  # fmt: skip
    """Step times of every layout, one step of each a round (a load spike hits all alike),
    and whether the packed and pad-to-max layouts compiled the same graph."""
    steps = {name: _step(arrays, args) for name, (arrays, _) in layouts.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in layouts}
    b = args.batch_size
    for s in range(args.steps + 1):  # the first round warms the backend up
        for name, (arrays, stats) in layouts.items():
            times[name].append(_timed(steps[name], arrays, stats.rows, s, b))
        buckets.time_round(s)
    out: dict[str, dict[str, Any]] = {}
    for name, (_, stats) in layouts.items():
        cpu = statistics.median(t[0] for t in times[name][1:])
        wall = statistics.median(t[1] for t in times[name][1:])
        epoch_steps = stats.rows / b
        out[name] = {"rows": stats.rows, "padded_share": stats.padded_share, "step_s": cpu,
                     "wall_step_s": wall, "trained_tokens": stats.trained,
                     "trained_tokens_per_s": stats.trained / (epoch_steps * cpu),
                     "wall_trained_tokens_per_s": stats.trained / (epoch_steps * wall)}  # fmt: skip
    out["buckets"] = buckets.result()
    return out, len({str(step.graph) for step in steps.values()}) == 1


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
    p.add_argument("--buckets", type=int, default=16, help="at most this many length buckets")
    args = p.parse_args()
    examples = _examples(args.examples, args.seq_len, args.vocab, args.seed)
    layouts = {name: pack_examples(examples, args.seq_len, 0, packing=packing)
               for name, packing in (("packed", True), ("pad-to-max", False))}  # fmt: skip
    for name, (_, stats) in layouts.items():
        print(stats.describe(name))
    buckets = _Buckets(examples, args)
    print(buckets.stats.describe("buckets"))
    results, same_graph = _measure(layouts, buckets, args)
    lo, med, p90, p99, hi = stats.lengths
    base = results["pad-to-max"]["trained_tokens_per_s"]
    speedup = results["packed"]["trained_tokens_per_s"] / base
    bucket_speedup = results["buckets"]["trained_tokens_per_s"] / base
    print(f"lengths min/median/p90/p99/max: {lo}/{med}/{p90}/{p99}/{hi}")
    for name, r in results.items():
        print(f"{name:>11}: {r['rows']} rows, {r['padded_share']:.1%} padding, step "
              f"{r['step_s'] * 1000:.0f} ms CPU ({r['wall_step_s'] * 1000:.0f} ms wall), "
              f"{r['trained_tokens_per_s']:.0f} trained tokens/s")  # fmt: skip
    print(f"packing: {speedup:.2f}x the trained tokens a second of pad-to-max; "
          f"both layouts compile {'the same' if same_graph else 'different'} graphs")  # fmt: skip
    print(f"buckets {results['buckets']['buckets']}: {bucket_speedup:.2f}x pad-to-max's")
    write_results("lm_packing", {"when": utc_now(), "args": vars(args),
                                 "threads": torch.get_num_threads(),
                                 "lengths": list(stats.lengths), "speedup": speedup,
                                 "bucket_speedup": bucket_speedup,
                                 "same_graph": same_graph, **results})  # fmt: skip


if __name__ == "__main__":
    main()
