"""The C backend's step with measured per-node convolution kernels against the rule's.

    OMP_NUM_THREADS=1 python benchmarks/c_tune_ab.py --workload mbv2 --scheme sparse \
        --rounds 8

In a fresh C cache dir (a temporary ``$PE_C_CACHE``): compiles the step with
``CBackend(tune=False)`` (kernel objects and step built cold), then with ``tune=True``
(the timing harness built and every conv node measured: the cold-cache tuned compile),
then ``tune=True`` again (the table read back: no measurement). Then steps the untuned and
tuned steps in turn, ``--rounds`` times each after one warm-up round, on the same batch;
prints the compile times, the time spent choosing kernels (timing them, or reading the
table), the median process CPU and wall seconds a step, the ratios, the kernels chosen,
and the largest loss difference. One JSON object on the last line.
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
from typing import Any


def _compile(workload: str, scheme_name: str, tune: bool) -> tuple[Any, list[Any], float]:
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="sparse")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pe-c-cache-") as cache:
        os.environ["PE_C_CACHE"] = cache
        from pockengine.backends.c import tune

        calls = collections.Counter[str]()
        measure = tune.measure

        def counted(op: str, kernels: list[str], *a: Any) -> dict[str, float]:
            calls["measure"] += len(kernels)
            return measure(op, kernels, *a)

        tune.measure = counted  # type: ignore[assignment]
        from pockengine.backends.c import backend as c_backend

        choose = c_backend.choose_kernels
        tuning: list[float] = []
        tuning_cpu: list[float] = []

        def timed(*a: Any) -> Any:
            start, cpu0 = time.perf_counter(), time.process_time()
            try:
                return choose(*a)
            finally:
                tuning.append(time.perf_counter() - start)
                tuning_cpu.append(time.process_time() - cpu0)

        c_backend.choose_kernels = timed  # type: ignore[assignment]
        plain, batch, t_plain = _compile(args.workload, args.scheme, False)
        tuned, _, t_tuned = _compile(args.workload, args.scheme, True)
        measured = calls["measure"]
        _, _, t_again = _compile(args.workload, args.scheme, True)
        again = calls["measure"] - measured
        steps = {"rule": plain, "tuned": tuned}
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        wall: dict[str, list[float]] = {k: [] for k in steps}
        losses: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds + 1):  # the first round is a warm-up
            for tag, step in steps.items():
                c0, w0 = time.process_time(), time.perf_counter()
                losses[tag].append(step(*batch))
                cpu[tag].append(time.process_time() - c0)
                wall[tag].append(time.perf_counter() - w0)
    choices = tuned._exec.kernel_choices
    kinds = collections.Counter(f"{c.op}:{c.kernel}" for c in choices)
    changed = sum(1 for c in choices if c.kernel != _rule(c, tuned))
    row = {
        "workload": args.workload, "scheme": args.scheme,
        "compile_s": {"rule_cold": t_plain, "tuned_cold_table": t_tuned, "tuned_cached": t_again},
        "tuning_s": {"cold_table": tuning[0], "cached": tuning[1]},
        "tuning_cpu_s": {"cold_table": tuning_cpu[0], "cached": tuning_cpu[1]},
        "measurements": measured, "measurements_second_compile": again,
        "tuned_nodes": len(choices), "nodes_off_rule": changed, "kernels": dict(kinds),
        "cpu_s": {k: statistics.median(v[1:]) for k, v in cpu.items()},
        "wall_s": {k: statistics.median(v[1:]) for k, v in wall.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(*losses.values(), strict=True)),
    }  # fmt: skip
    row["cpu_ratio_tuned_over_rule"] = row["cpu_s"]["tuned"] / row["cpu_s"]["rule"]
    row["wall_ratio_tuned_over_rule"] = row["wall_s"]["tuned"] / row["wall_s"]["rule"]
    print(tuned.report())
    print(json.dumps(row))
    return 0


def _rule(choice: Any, step: Any) -> str:
    from pockengine.backends.c.conv_kernels import conv_geometry, rule_kernel
    from pockengine.backends.c.lower_layout import nhwc_geometry

    nodes = step._exec.graph.nodes
    node = next(  # an NHWC convolution's own output, or the conversion of it back to NCHW
        n for n in nodes if n.outputs and n.outputs[0].name == choice.output
    )
    if node.op == "layout_convert":
        node = next(n for n in nodes if n.outputs[0] == node.inputs[0])
    geometry = nhwc_geometry(node) if "nhwc" in node.op else conv_geometry(node)
    return rule_kernel(choice.op, geometry, node.outputs[0].dtype.itemsize)


if __name__ == "__main__":
    sys.exit(main())
