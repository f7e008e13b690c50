"""Compile-time cost of the sparse schemes, as ratios to full backprop.

    python benchmarks/sparse_table.py            # writes benchmarks/results/sparse_table.json
                                                 # and its table in docs/sparse_backprop.md

For MobileNetV2 (width 1.0, 3x128x128, batch 8), a 6-layer BERT encoder (hidden 384,
seq 128, batch 8) and a LLaMA decoder (8 layers, hidden 512, seq 256, batch 1), under
full, bias-only, the PockEngine recipe and head-only: backward FLOPs, saved-activation
bytes and planned peak, read off the compiled training graphs (nothing is run).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from _harness import write_results

WORKLOADS = ("mbv2", "bert", "llama")


def measure(name: str) -> list[dict[str, Any]]:
    import pockengine as pe
    from pockengine import zoo

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = parser.parse_args()
    rows = [r for name in args.workloads for r in measure(name)]
    write_results("sparse_table", rows, indent=1)
    import docs_tables  # the table between its markers, as every docs table is written

    for path, text in docs_tables.generated().items():
        path.write_text(text, encoding="utf-8")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
