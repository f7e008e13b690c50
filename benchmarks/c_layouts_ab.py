"""The C backend's step with the layouts the tuner picks against NCHW only.

    OMP_NUM_THREADS=1 python benchmarks/c_layouts_ab.py --workload mbv2 --scheme sparse \
        --rounds 10 --out benchmarks/results/c_layouts_ab-mbv2-sparse-1thread.json

In a fresh C cache dir (a temporary ``$PE_C_CACHE``): compiles the step with
``CBackend(tune=True)`` twice, once with the layout choice off (every convolution NCHW,
each node's kernel measured) and once with it on (each convolution that has an NHWC
kernel also timed as ``nhwc``: conversions in, the NHWC kernel, conversion out; each
depthwise one also as ``nchwc``, the same around the channel-blocked kernel; the fastest
kept where it is 10% faster), once more with the blocked candidate off (each convolution
NCHW or NHWC), and with ``CBackend(tune=False)`` twice (the rule's kernels, all
NCHW; and with the heuristic's layouts), then steps the five in turn, ``--rounds`` times
each after one warm-up round, on the same batch, in one process. Prints and writes
(``--out``) one JSON object: the compile times (the second one's layout measurement
included), the median process CPU and wall seconds a step and their ratios, the largest
loss difference between the steps (float32 MobileNetV2 trained on one batch drifts
apart after a few steps; the first step's difference is the rounding), the conversions
NHWC and NCHW{c}c convolutions in the step, and every candidate node's measured NCHW,
NHWC and NCHW{c}c times with the layout chosen.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import steps_in_turn


def _compile(workload: str, scheme_name: str, tune: bool = True) -> tuple[Any, list[Any], float]:
    import pockengine as pe
    from pockengine import zoo
    from pockengine.backends.c import CBackend

    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    start = time.perf_counter()
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                      backend=CBackend(threads=1, tune=tune), compile_in="process")  # fmt: skip
    return step, batch, time.perf_counter() - start


def _layouts(step: Any) -> list[dict[str, Any]]:
    from pockengine.backends.c.layout_tune import BLOCKED_KERNEL, LAYOUT_KERNELS, NHWC_KERNEL

    rows = []
    names = {NHWC_KERNEL: "NHWC", BLOCKED_KERNEL: "NCHWc"}
    for c in step._exec.kernel_choices:
        if not set(LAYOUT_KERNELS) & c.seconds.keys():
            continue
        nchw = {k: v for k, v in c.seconds.items() if k not in LAYOUT_KERNELS}
        best = min(nchw, key=lambda k: nchw[k])
        rows.append({
            "op": c.op, "node": c.output, "layout": names.get(c.kernel, "NCHW"),
            "nchw_kernel": best, "nchw_s": nchw[best], "nhwc_s": c.seconds.get(NHWC_KERNEL),
            "nchwc_s": c.seconds.get(BLOCKED_KERNEL),
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="sparse")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pe-c-cache-") as cache:
        os.environ["PE_C_CACHE"] = cache
        from pockengine.backends.c import backend as c_backend

        choose, heuristic = c_backend.choose_layouts, c_backend.heuristic_nhwc
        c_backend.choose_layouts = lambda *a, **k: []  # type: ignore[assignment]
        c_backend.heuristic_nhwc = lambda *a, **k: set()  # type: ignore[assignment]
        nchw, batch, t_nchw = _compile(args.workload, args.scheme)
        rule, _, _ = _compile(args.workload, args.scheme, tune=False)
        c_backend.choose_layouts, c_backend.heuristic_nhwc = choose, heuristic  # type: ignore[assignment]
        tuned, _, t_tuned = _compile(args.workload, args.scheme)
        untuned, _, _ = _compile(args.workload, args.scheme, tune=False)
        from pockengine.backends.c import layout_tune

        variants = layout_tune._variants  # the candidates without the blocked layout
        layout_tune._variants = lambda node: tuple(  # type: ignore[assignment]
            v for v in variants(node) if v != layout_tune.BLOCKED_KERNEL
        )
        nhwc_only, _, _ = _compile(args.workload, args.scheme)
        layout_tune._variants = variants  # type: ignore[assignment]
        steps = {"nchw": nchw, "layouts": tuned, "rule_nchw": rule, "rule_heuristic": untuned,
                 "layouts_nhwc_only": nhwc_only}  # fmt: skip
        cpu, wall, losses = steps_in_turn(steps, batch, args.rounds)  # one warm-up round
    ops = collections.Counter(n.op for n in tuned._exec.graph.nodes)
    layouts = _layouts(tuned)
    row = {
        "workload": args.workload, "scheme": args.scheme, "threads": 1, "rounds": args.rounds,
        "compile_s": {"nchw_tuned_cold": t_nchw, "layouts_tuned_kernels_cached": t_tuned},
        "cpu_s": {k: statistics.median(v[1:]) for k, v in cpu.items()},
        "wall_s": {k: statistics.median(v[1:]) for k, v in wall.items()},
        "max_loss_diff": max(max(v) - min(v) for v in zip(*losses.values(), strict=True)),
        "first_loss_diff": max(v[0] for v in losses.values()) - min(v[0] for v in losses.values()),
        "conversions": ops["layout_convert"],
        "nhwc_convolutions": sum(v for k, v in ops.items() if k.startswith("conv2d_nhwc")),
        "nchwc_convolutions": sum(v for k, v in ops.items() if k.startswith("conv2d_nchwc")),
        "candidates": len(layouts),
        "chosen_nhwc": collections.Counter(r["op"] for r in layouts if r["layout"] == "NHWC"),
        "chosen_nchwc": collections.Counter(r["op"] for r in layouts if r["layout"] == "NCHWc"),
        "plan_arena_mib": {k: s._exec.plan.arena_bytes / 2**20 for k, s in steps.items()},
        "load_average": os.getloadavg()[0],
        "layouts": layouts,
    }  # fmt: skip
    row["cpu_ratio_layouts_over_nchw"] = row["cpu_s"]["layouts"] / row["cpu_s"]["nchw"]
    row["wall_ratio_layouts_over_nchw"] = row["wall_s"]["layouts"] / row["wall_s"]["nchw"]
    row["cpu_ratio_layouts_over_nhwc_only"] = (
        row["cpu_s"]["layouts"] / row["cpu_s"]["layouts_nhwc_only"]
    )
    row["cpu_ratio_heuristic_over_rule_nchw"] = (
        row["cpu_s"]["rule_heuristic"] / row["cpu_s"]["rule_nchw"]
    )
    row["heuristic_nhwc_convolutions"] = sum(
        n.op.startswith("conv2d_nhwc") for n in untuned._exec.graph.nodes
    )
    text = json.dumps(row, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
