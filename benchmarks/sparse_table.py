"""Compile-time cost of the sparse schemes, as ratios to full backprop.

    python benchmarks/sparse_table.py            # writes docs/sparse_backprop.md and
                                                 # benchmarks/results/sparse_table.json

For MobileNetV2 (width 1.0, 3x128x128, batch 8), a 6-layer BERT encoder (hidden 384,
seq 128, batch 8) and a LLaMA decoder (8 layers, hidden 512, seq 256, batch 1), under
full, bias-only, the PockEngine recipe and head-only: backward FLOPs, saved-activation
bytes and planned peak, read off the compiled training graphs (nothing is run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _harness import ROOT, write_results

import pockengine as pe
from pockengine import zoo

WORKLOADS = ("mbv2", "bert", "llama")


def measure(name: str) -> list[dict[str, Any]]:
    work, optimizer = zoo.benchmark(name)
    batch = work.make_batch(0)
    rows = []
    for label, scheme in zoo.benchmark_schemes(name).items():
        step = pe.compile(work.model, work.loss_fn, batch, optimizer=optimizer, scheme=scheme)
        report = step.report()
        rows.append({**report.to_dict(), "workload": name, "scheme": label})
        print(f"{name:6} {label:7} bwd x{report.ratio('backward_flops'):.2f}", file=sys.stderr)
    return rows


def _cell(ours: float, full: float, unit: float, fmt: str) -> str:
    ratio = ours / full if full else 0.0
    return f"{ours / unit:{fmt}} ({ratio:.2f})"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | scheme | trained params | backward GFLOP | saved activations MiB "
        "| planned peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, f = r["ours"], r["full"]
        lines.append(
            f"| {r['workload']} | {r['scheme']} | {o['trained_elements']:,} "
            f"| {_cell(o['backward_flops'], f['backward_flops'], 1e9, '.2f')} "
            f"| {_cell(o['saved_activation_bytes'], f['saved_activation_bytes'], 2**20, '.1f')} "
            f"| {_cell(o['planned_peak_bytes'], f['planned_peak_bytes'], 2**20, '.1f')} |"
        )
    return "\n".join(lines)


HEADER = """# Sparse backpropagation: compile-time cost

Produced by `python benchmarks/sparse_table.py` (nothing is executed: the figures are
read off the compiled training graphs by `TrainStep.report()`). Each cell: the value,
and in parentheses its ratio to full backprop of the same workload. Schemes: *full*
trains every parameter; *bias-only* every bias and normalisation parameter; *sparse* is
the PockEngine recipe (biases and norms everywhere, all weights of the last blocks —
4 for MobileNetV2, 2 for the transformers — and the head); *head* the last linear
layer only. Optimizers: SGD with momentum for MobileNetV2, AdamW for the
transformers (its two moments count in the planned peak).

Workloads: MobileNetV2 width 1.0, 3x128x128, batch 8; BERT encoder 6 layers, hidden
384, 12 heads, FFN 1536, seq 128, batch 8, with a 4-class head; LLaMA decoder 8
layers, hidden 512, 8 heads, FFN 1376, vocab 32000, seq 256, batch 1.

"""

NOTES = """

Reading the table:
- Bias and norm updates need the activation gradient everywhere, so the backward
  still reaches the first layer, but no weight gradient is computed and the inputs
  of convolutions and matmuls are no longer saved for them.
- Head-only stops the backward at the head: its backward is one small matmul and
  almost nothing is saved.
- The planned peak is the static memory plan (arena of temporaries + params +
  buffers + optimizer state); for the LLaMA decoder the 32000-token embedding and
  head dominate it.
## Scheme names

One vocabulary (`pockengine/sparse/names.py`) serves `pockengine inspect`, `finetune`,
`search`, `export` and the API (`pockengine.sparse.names.scheme_named(name)`); each name
trains the same parameters everywhere:

| name | trains | as a factory of `pe.schemes` |
|---|---|---|
| `full` | every parameter | `full()` |
| `bias` | every bias and normalisation parameter, and the head (1) | `sparse(blocks=0)` |
| `bias-only` | every bias and normalisation parameter (the tables above) | `bias_only()` |
| `sparse` | biases and norms, the last blocks' weights, the head (2) | `sparse()` (2) |
| `head` | the last linear layer | `head()` |
| `last:K` | every parameter of the last K repeated blocks, and the head | `last_blocks(K)` |
| `*.json`, `*.yaml`, `*.yml` | what the scheme file says | `schemes.load(path)` |

(1) BitFit, with the head that a new task must train. (2) The model's sparse recipe: the
last 2 blocks unless the workload or recipe declares its own: `zoo.RECIPE_BLOCKS` (mbv2 4,
bert 2, llama 2), `Recipe.sparse` (smollm2-pydocs: the norms and every block's output
projections).

Under a name, BatchNorm layers that train nothing run on their running statistics
(`frozen_bn="eval"`, what `finetune` and `search` always do, and the default of `inspect
--frozen-bn` and `export --frozen-bn`): a short fine-tune barely moves them. The tables
above were measured with `frozen_bn="train"` (`zoo.benchmark_schemes`), as `--frozen-bn
train` reproduces.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "sparse_backprop.md"))
    args = parser.parse_args()
    rows = [r for name in args.workloads for r in measure(name)]
    write_results("sparse_table", rows, indent=1)
    Path(args.out).write_text(HEADER + markdown(rows) + NOTES)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
