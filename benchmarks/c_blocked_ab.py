"""The C backend's default step (no tuning: the rule's kernels and the heuristic's layouts)
with the blocked depthwise kernels against without them, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_blocked_ab.py --workload mbv2 --scheme sparse \
        --rounds 10 --out benchmarks/results/c_blocked_ab-mbv2-sparse-1thread.json

Compiles the workload's step with ``backend=CBackend(threads=1)`` (``--portable``: the
portable build) twice: as it is (the rule takes ``blocked`` for depthwise convolutions
whose blocks fit, with the wide FMA vectors only on output maps of at most
``conv_kernels.BLOCKED_MAX_MAP`` positions, so the heuristic keeps them NCHW) and without
it (``BLOCKED_MAX_MAP`` 0 and ``blocked_fits`` false: the depthwise kernels or direct
loops, and NHWC for maps of at most 16 positions, with their conversions). Steps the two
in turn, ``--rounds`` times each after one warm-up round, on the same batch. Prints and
writes (``--out``) one JSON object: the median process CPU and wall seconds a step and
their ratio, the largest loss difference, how many nodes run each way, and the two
steps' arena sizes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from _harness import steps_in_turn

from pockengine.finetune.arg_types import positive_int


def _compile(workload: str, scheme_name: str, portable: bool) -> tuple[Any, list[Any]]:
    import pockengine as pe
    from pockengine import zoo
    from pockengine.backends.c import CBackend

    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                      backend=CBackend(portable, threads=1), compile_in="process")  # fmt: skip
    return step, batch


def _kernels(step: Any) -> dict[str, int]:
    source = step._exec.source
    ops = collections.Counter(n.op for n in step._exec.graph.nodes)
    return {
        "blocked": source.count("_blocked_f"),
        "nhwc_convolutions": sum(v for k, v in ops.items() if k.startswith("conv2d_nhwc")),
        "conversions": ops["layout_convert"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="sparse")
    parser.add_argument("--rounds", type=positive_int, default=10)
    parser.add_argument("--portable", action="store_true", help="the portable build (-O3)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from pockengine.backends.c import conv_kernels

    blocked, batch = _compile(args.workload, args.scheme, args.portable)
    limit, fits = conv_kernels.BLOCKED_MAX_MAP, conv_kernels.blocked_fits
    conv_kernels.BLOCKED_MAX_MAP = 0
    conv_kernels.blocked_fits = lambda op, g: False  # type: ignore[assignment]
    try:
        without, _ = _compile(args.workload, args.scheme, args.portable)
    finally:
        conv_kernels.BLOCKED_MAX_MAP, conv_kernels.blocked_fits = limit, fits  # type: ignore[assignment]
    steps = {"blocked": blocked, "without": without}
    cpu, wall, losses = steps_in_turn(steps, batch, args.rounds)  # one warm-up round
    row: dict[str, Any] = {
        "workload": args.workload, "scheme": args.scheme, "threads": 1, "rounds": args.rounds,
        "portable": args.portable,
        "cpu_s": {k: statistics.median(v[1:]) for k, v in cpu.items()},
        "wall_s": {k: statistics.median(v[1:]) for k, v in wall.items()},
        "first_loss_diff": abs(losses["blocked"][0] - losses["without"][0]),
        "max_loss_diff": max(abs(a - b) for a, b in zip(*losses.values(), strict=True)),
        "nodes": {k: _kernels(s) for k, s in steps.items()},
        "plan_arena_mib": {k: s._exec.plan.arena_bytes / 2**20 for k, s in steps.items()},
        "load_average": os.getloadavg()[0],
    }  # fmt: skip
    row["cpu_ratio"] = row["cpu_s"]["blocked"] / row["cpu_s"]["without"]
    row["wall_ratio"] = row["wall_s"]["blocked"] / row["wall_s"]["without"]
    text = json.dumps(row, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
