"""Recomputation under a memory budget: planned and measured peak, step time, per budget.

    python benchmarks/remat_budget.py                          # the benchmark LLaMA
    python benchmarks/remat_budget.py --layers 2 --steps 3 --fractions 1 0.8 0.6

Workload: the zoo's benchmark LLaMA (``zoo.BENCHMARKS["llama"]``: hidden 512, 8 heads,
FFN 1376, vocab 32000, 256 tokens, batch 1; ``--layers`` cuts its depth), the workload's
sparse scheme, AdamW, the torch backend. Each budget (the persistent bytes, params and
optimizer state, plus a fraction of the arena planned without a budget; 1 = no budget)
runs in its own process, which reports the planned peak, the
recomputed FLOPs, its whole-process peak RSS (VmHWM), compile time and the median step
time. Writes benchmarks/results/remat_budget.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _harness import run_child, vm_mib, write_results

MIB = 1 << 20


def _workload(layers: int) -> tuple[Any, Any]:
    from pockengine import zoo

    work = zoo.llama_lm(layers=layers, hidden=512, heads=8, kv_heads=8, ffn=1376, vocab=32000,
                        seq=256, batch=1)  # fmt: skip
    return work, zoo.workload_sparse("llama")


def run_case(layers: int, fraction: float, base: tuple[int, int], steps: int) -> dict[str, Any]:
    import pockengine as pe
    from pockengine.plan import plan_memory

    work, scheme = _workload(layers)
    budget = None if fraction >= 1 else int(base[0] + fraction * base[1])
    t0 = time.perf_counter()
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(lr=1e-4),
                      scheme, backend="torch", memory_budget=budget)  # fmt: skip
    compile_s = time.perf_counter() - t0
    del work.model
    times = []
    for k in range(steps):
        batch = work.make_batch(k)
        t = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - t)
    remat = step.report().recomputation
    return {
        "fraction": fraction,
        "budget_mib": None if budget is None else budget / MIB,
        "planned_peak_mib": plan_memory(step.graph).planned_peak_bytes / MIB,
        "met": True if remat is None else remat.met,
        "extra_gflop": 0.0 if remat is None else remat.extra_flops / 1e9,
        "extra_share": 0.0 if remat is None else remat.extra_flops / remat.step_flops,
        "segments": 0 if remat is None else len(remat.segments),
        "vmhwm_mib": vm_mib("VmHWM"),
        "compile_s": compile_s,
        "step_s": statistics.median(times[1:] or times),
    }


def _base_plan(layers: int) -> tuple[int, int]:
    """Persistent and arena bytes of the plan without a budget."""
    import pockengine as pe
    from pockengine.plan import plan_memory

    work, scheme = _workload(layers)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(lr=1e-4),
                      scheme, backend="torch")  # fmt: skip
    plan = plan_memory(step.graph)
    return plan.persistent_bytes, plan.arena_bytes


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| budget | planned peak MiB | met | recomputed (share of step FLOPs) | segments "
        "| peak RSS MiB | step s | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "none" if r["budget_mib"] is None else f"{r['budget_mib']:.0f} MiB"
        lines.append(
            f"| {budget} | {r['planned_peak_mib']:.1f} | {'yes' if r['met'] else 'no'} | "
            f"{r['extra_gflop']:.3f} GFLOP ({r['extra_share']:.1%}) | {r['segments']} | "
            f"{r['vmhwm_mib']:.0f} | {r['step_s']:.3f} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.85, 0.7, 0.55])
    parser.add_argument("--case", nargs=3, type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        fraction, persistent, arena = args.case
        print(
            json.dumps(run_case(args.layers, fraction, (int(persistent), int(arena)), args.steps))
        )
        return 0
    base = _base_plan(args.layers)
    rows = []
    for fraction in args.fractions:
        rows.append(run_child([__file__, "--layers", args.layers, "--steps", args.steps,
                               "--case", fraction, *base]))  # fmt: skip
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    result = {"layers": args.layers, "steps": args.steps, "persistent_bytes": base[0],
              "arena_bytes": base[1], "rows": rows}  # fmt: skip
    write_results("remat_budget", result)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
