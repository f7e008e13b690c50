"""The C backend's tuned step with each GEMM node's micro-kernel shape chosen by measurement
against the same tuned step on the default shape, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_shapes_ab.py --workload mbv2 --scheme sparse \
        --rounds 10 --out benchmarks/results/c_shapes_ab-mbv2-sparse-1thread.json

Compiles the workload's step with ``backend=CBackend(tune=True, threads=1)`` twice: as it
is (``shape_tune.choose_shapes`` times the build's three shapes on every GEMM node) and
with the shape choice off (every node on shape 0; the kernels and layouts are the same
measured ones, read from the table). Steps the two in turn, ``--rounds`` times each after
one warm-up round, on the same batch. Prints and writes (``--out``) one JSON object: the
median process CPU and wall seconds a step and their ratio, the largest loss difference
(the shapes compute the same bits, so 0), how many nodes run each shape, and the compile
times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _harness import steps_in_turn

from pockengine.finetune.arg_types import positive_int


def _compile(workload: str, scheme_name: str) -> tuple[Any, list[Any], float]:
    import pockengine as pe
    from pockengine import zoo
    from pockengine.backends.c import CBackend

    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    start = time.perf_counter()
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                      backend=CBackend(tune=True, threads=1), compile_in="process")  # fmt: skip
    return step, batch, time.perf_counter() - start


def _shapes(step: Any) -> dict[str, int]:
    """How many GEMM nodes were timed, and how many run each shape."""
    counts = collections.Counter(c.shape for c in step.report().kernels if c.shape)
    return dict(sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="sparse")
    parser.add_argument("--rounds", type=positive_int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from pockengine.backends.c import backend

    shaped, batch, shaped_s = _compile(args.workload, args.scheme)
    choose = backend.choose_shapes
    backend.choose_shapes = lambda *a, **k: []  # type: ignore[assignment]
    try:
        default, _, default_s = _compile(args.workload, args.scheme)
    finally:
        backend.choose_shapes = choose  # type: ignore[assignment]
    steps = {"shapes": shaped, "default": default}
    cpu, wall, losses = steps_in_turn(steps, batch, args.rounds)  # one warm-up round
    row: dict[str, Any] = {
        "workload": args.workload, "scheme": args.scheme, "threads": 1, "rounds": args.rounds,
        "cpu_s": {k: statistics.median(v[1:]) for k, v in cpu.items()},
        "wall_s": {k: statistics.median(v[1:]) for k, v in wall.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(*losses.values(), strict=True)),
        "gemm_nodes_by_shape": _shapes(shaped),
        "compile_s": {"shapes (first)": shaped_s, "default (cached kernels)": default_s},
        "load_average": os.getloadavg()[0],
    }  # fmt: skip
    row["cpu_ratio"] = row["cpu_s"]["shapes"] / row["cpu_s"]["default"]
    row["wall_ratio"] = row["wall_s"]["shapes"] / row["wall_s"]["default"]
    text = json.dumps(row, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
