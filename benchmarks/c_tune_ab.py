"""The C backend's step with measured per-node convolution kernels against the rule's.

    OMP_NUM_THREADS=1 python benchmarks/c_tune_ab.py --workload mbv2 --scheme sparse \
        --rounds 8

In a fresh C cache dir (a temporary ``$PE_C_CACHE``): compiles the step with
``CBackend(tune=False)`` (kernel objects and step built cold), then with ``tune=True``
(the timing harness built and every conv node measured: the cold-cache tuned compile),
then ``tune=True`` again (the table read back: no measurement). Then steps the untuned and
tuned steps in turn, ``--rounds`` times each after one warm-up round, on the same batch;
prints the compile times and their split (wall and CPU seconds, the C compiler's
included: choosing kernels, layouts and GEMM micro-kernel shapes, each with its timing
harness's build; building the harnesses; building the step; the C backend in all, the rest being the
frontend's tracing and the passes), the time spent choosing (timing, or reading the
tables), the load average, the median process CPU and wall seconds a step, the ratios,
the kernels chosen, and the largest loss difference. One JSON object on the last line.
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

from _harness import steps_in_turn


def _compile(workload: str, scheme_name: str, tune: bool) -> tuple[Any, list[Any], float]:
    """The step, its batch and the compile's wall seconds (its CPU seconds, the C
    compiler's included, go to stderr and the split as ``total``)."""
    import pockengine as pe
    from pockengine import zoo
    from pockengine.backends.c import CBackend

    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    start, cpu0 = time.perf_counter(), _cpu()
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                      backend=CBackend(threads=1, tune=tune), compile_in="process")  # fmt: skip
    _TOTAL.update(wall=time.perf_counter() - start, cpu=_cpu() - cpu0)
    return step, batch, _TOTAL["wall"]


_TOTAL: dict[str, float] = {}  # the last compile's wall and CPU seconds


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children (the C compiler)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _Parts:
    """Wall and CPU seconds spent in the parts of a compile, by wrapping their functions:
    choosing kernels and layouts (each with its harness build), building libraries (the
    harnesses' and the step's), and the C backend as a whole (the rest of a compile is
    the frontend's tracing and the passes)."""

    def __init__(self) -> None:
        from pockengine.backends.c import backend, tune_harness

        self.seconds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        self._wrap(backend, "choose_kernels", "choose_kernels")
        self._wrap(backend, "choose_layouts", "choose_layouts")
        self._wrap(backend, "choose_shapes", "choose_shapes")
        self._wrap(tune_harness, "build_library", "build_harness")
        self._wrap(backend, "build_library", "build_step")
        self._wrap(backend.CExecutable, "__init__", "c_backend")

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a: Any, **kw: Any) -> Any:
            start, cpu0 = time.perf_counter(), _cpu()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[label][0] += time.perf_counter() - start
                self.seconds[label][1] += _cpu() - cpu0

        setattr(owner, name, timed)

    def take(self) -> dict[str, dict[str, float]]:
        """The seconds so far (``wall``, ``cpu`` by part), then start again from zero."""
        out = {k: {"wall": v[0], "cpu": v[1]} for k, v in self.seconds.items()}
        out["total"] = dict(_TOTAL)
        self.seconds.clear()
        return out


def _tuning(split: dict[str, dict[str, float]], kind: str) -> float:
    parts = ("choose_kernels", "choose_layouts", "choose_shapes")
    return sum(split.get(k, {}).get(kind, 0.0) for k in parts)


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
            calls["layouts"] += len(a[5]) if len(a) > 5 else 0  # layout variants beside them
            return measure(op, kernels, *a)

        tune.measure = counted  # type: ignore[assignment]
        from pockengine.backends.c import layout_tune

        measure_layouts = layout_tune.measure_layouts

        def counted_layouts(op: str, kernel: str, *a: Any) -> dict[str, float]:
            variants = a[5] if len(a) > 5 else (layout_tune.NHWC_KERNEL,)
            calls["layouts"] += 1 + len(variants) if len(a) < 5 or a[4] is None else 0
            return measure_layouts(op, kernel, *a)

        layout_tune.measure_layouts = counted_layouts  # type: ignore[assignment]
        parts = _Parts()
        plain, batch, t_plain = _compile(args.workload, args.scheme, False)
        split = [parts.take()]
        tuned, _, t_tuned = _compile(args.workload, args.scheme, True)
        split.append(parts.take())
        print(json.dumps({"tuned_cold_table_s": t_tuned, "split_s": split[1]}), file=sys.stderr)
        measured, measured_layouts = calls["measure"], calls["layouts"]
        _, _, t_again = _compile(args.workload, args.scheme, True)
        split.append(parts.take())
        again = calls["measure"] - measured
        steps = {"rule": plain, "tuned": tuned}
        cpu, wall, losses = steps_in_turn(steps, batch, args.rounds)  # one warm-up round
    choices = tuned._exec.kernel_choices
    kinds = collections.Counter(f"{c.op}:{c.kernel}" for c in choices)
    changed = sum(1 for c in choices if c.kernel != _rule(c, tuned))
    row = {
        "workload": args.workload, "scheme": args.scheme,
        "compile_s": {"rule_cold": t_plain, "tuned_cold_table": t_tuned, "tuned_cached": t_again},
        "tuning_s": {"cold_table": _tuning(split[1], "wall"), "cached": _tuning(split[2], "wall")},
        "tuning_cpu_s": {"cold_table": _tuning(split[1], "cpu"),
                         "cached": _tuning(split[2], "cpu")},
        "split_s": {"rule_cold": split[0], "tuned_cold_table": split[1], "tuned_cached": split[2]},
        "load": os.getloadavg(),
        "measurements": measured, "layout_measurements": measured_layouts,
        "measurements_second_compile": again,
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
    from pockengine.backends.c.driver import has_fast_gemm

    nodes = step._exec.graph.nodes
    node = next(  # an NHWC convolution's own output, or the conversion of it back to NCHW
        n for n in nodes if n.outputs and n.outputs[0].name == choice.output
    )
    if node.op == "layout_convert":
        node = next(n for n in nodes if n.outputs and n.outputs[0] == node.inputs[0])
    geometry, size = conv_geometry(node), node.outputs[0].dtype.itemsize
    return rule_kernel(choice.op, geometry, size, fast_gemm=has_fast_gemm(None))


if __name__ == "__main__":
    sys.exit(main())
