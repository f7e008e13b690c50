"""The C backend's step with the fused vocabulary loss against the same step unfused.

    OMP_NUM_THREADS=1 python benchmarks/c_fused_loss_ab.py --workload llama \
        --scheme bias-only --rounds 6

Both steps are compiled in this process (the unfused one with the forward pipeline minus
``fuse_linear_cross_entropy``), then stepped in turn, ``--rounds`` times each, on the same
batch, so both meet the same load. Prints the median wall and CPU seconds a step (the
first round is warm-up), the planned arena of each, and the losses. One JSON object on the
last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import pockengine as pe
import pockengine.step.parts
from pockengine import zoo
from pockengine.backends.c import CBackend
from pockengine.passes import FORWARD_PIPELINE, fuse_linear_cross_entropy
from pockengine.plan import plan_memory


def _compile(workload: str, scheme: str, fused: bool, threads: int) -> Any:
    work, opt = zoo.benchmark(workload)
    batch = work.make_batch(0)
    original = pockengine.step.parts.forward_passes
    if not fused:
        kept = tuple(p for p in FORWARD_PIPELINE if p is not fuse_linear_cross_entropy)
        pockengine.step.parts.forward_passes = lambda supported: kept  # type: ignore[assignment]
    try:
        scheme_of = zoo.benchmark_schemes(workload)[scheme]
        step = pe.compile(work.model, work.loss_fn, batch, opt, scheme_of,
                          backend=CBackend(threads=threads))  # fmt: skip
    finally:
        pockengine.step.parts.forward_passes = original  # type: ignore[assignment]
    has_fused = any(n.op.startswith("linear_log_softmax_gather") for n in step.graph.nodes)
    if has_fused != fused:  # the patch above must reach the compiler
        raise SystemExit(f"the {'fused' if fused else 'unfused'} step came out otherwise")
    return step, batch


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="llama")
    parser.add_argument("--scheme", default="bias-only")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    steps = {name: _compile(args.workload, args.scheme, name == "fused", args.threads)
             for name in ("fused", "unfused")}  # fmt: skip
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, (step, batch) in steps.items():
            t, c = time.perf_counter(), time.process_time()
            losses[name].append(step(*batch))
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    result: dict[str, Any] = {"workload": args.workload, "scheme": args.scheme}
    for name, (step, _) in steps.items():
        result[name] = {
            "wall_s": statistics.median(wall[name][1:]),
            "cpu_s": statistics.median(cpu[name][1:]),
            "arena_mib": plan_memory(step.graph).arena_bytes / 2**20,
            "losses": losses[name],
        }
        print(f"{name:8s} wall {result[name]['wall_s']:.3f} s  cpu {result[name]['cpu_s']:.3f} s"
              f"  arena {result[name]['arena_mib']:.1f} MiB")  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
