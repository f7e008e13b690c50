"""The C backend's max pooling, and a whole VGG-style step, with the kernels of a git
revision against the working tree's, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_pool_ab.py --rev b3e72e4 --rounds 15 \
        --out benchmarks/results/c_pool_ab-padded-1thread.json

Both builds are compiled here (the revision's ``kernels/`` extracted with ``git show``),
then run in turn: a graph of ``max_pool2d`` and ``max_pool2d_grad`` on each shape of
``SHAPES`` (float32), profiled per node over ``--rounds`` runs, then the VGG-style CNN of
``c_winograd.py`` (its step's median process CPU time over ``--rounds`` steps, after one
warm-up). Prints the milliseconds of each and their ratio, then one JSON object;
``--out`` writes it to a file. Both builds must give the same bits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _harness import extract_kernels, out_file, write_out
from c_winograd import _vgg

from pockengine.finetune.arg_types import positive_int

# (name, input shape, kernel, stride, padding)
SHAPES = [
    ("vgg 32ch 32px, 2x2/2", (8, 32, 32, 32), (2, 2), (2, 2), (0, 0)),
    ("resnet stem 64ch 64px, 3x3/2", (8, 64, 64, 64), (3, 3), (2, 2), (0, 0)),
    ("resnet stem 64ch 112px, 3x3/2 pad 1", (4, 64, 112, 112), (3, 3), (2, 2), (1, 1)),
]


def _pool_graph() -> tuple[Any, dict[str, Any]]:
    from pockengine.ir import DType, GraphBuilder, Role, TensorType

    b = GraphBuilder("pools")
    outs, feeds = [], {}
    rng = np.random.default_rng(0)
    for i, (_, shape, kernel, stride, padding) in enumerate(SHAPES):
        attrs = {"kernel": kernel, "stride": stride, "padding": padding, "dilation": (1, 1),
                 "ceil_mode": False}  # fmt: skip
        x = b.input(f"x{i}", TensorType(shape, DType.F32), Role.INPUT)
        y = b.call("max_pool2d", x, **attrs)
        gy = b.input(f"gy{i}", TensorType(y.shape, DType.F32), Role.INPUT)
        outs += [y, b.call("max_pool2d_grad", gy, x, **attrs)]
        feeds[f"x{i}"] = rng.random(shape, dtype=np.float32)
        feeds[f"gy{i}"] = rng.random(y.shape, dtype=np.float32)
    return b.build(outs), feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the baseline's git revision")
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", type=out_file, help="also write the JSON here")
    args = parser.parse_args()

    import pockengine as pe
    from pockengine.backends.c import CBackend, driver

    old = Path(tempfile.mkdtemp())
    extract_kernels(args.rev, old)
    graph, feeds = _pool_graph()
    model, loss_fn, batch = _vgg()
    builds: dict[str, tuple[Any, Any]] = {}
    for name, kernels in ((args.rev, old), ("tree", driver.KERNEL_DIR)):
        driver.KERNEL_DIR = kernels  # read by kernel_sources() and the -I flag when building
        pools = CBackend(threads=args.threads, profile=True).compile(graph)
        step = pe.compile(model, loss_fn, batch, pe.optim.SGD(lr=0.01),
                          backend=CBackend(threads=args.threads))  # fmt: skip
        builds[name] = pools, step
    outputs = [pools.run({}, dict(feeds)) for pools, _ in builds.values()]
    same = all(np.array_equal(a, b) for a, b in zip(*outputs, strict=True))
    for _ in range(args.rounds + 1):
        for pools, _ in builds.values():
            pools.run({}, dict(feeds))
    steps: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(args.rounds + 1):  # the steps in turn, apart from the pooling graphs
        for name, (_, step) in builds.items():
            start = time.process_time()
            step(*batch)
            steps[name].append(time.process_time() - start)
    rows = []
    nodes = {name: {text.split(":")[0]: s / (args.rounds + 2) for s, text in pools.node_seconds()}
             for name, (pools, _) in builds.items()}  # fmt: skip
    for i, (label, *_) in enumerate(SHAPES):
        for op, node in (("max_pool2d", f"%max_pool2d{2 * i}"),
                         ("max_pool2d_grad", f"%max_pool2d_grad{2 * i + 1}")):  # fmt: skip
            ms = {name: 1e3 * nodes[name][node] for name in builds}
            rows.append({"shape": label, "op": op, "ms": {k: round(v, 3) for k, v in ms.items()},
                         "ratio": round(ms["tree"] / ms[args.rev], 3)})  # fmt: skip
    med = {name: statistics.median(s[1:]) for name, s in steps.items()}
    for r in rows:
        print(f"{r['shape']:30} {r['op']:16} {r['ms'][args.rev]:8.3f} -> {r['ms']['tree']:8.3f} ms"
              f"  {r['ratio']:.2f}x")  # fmt: skip
    ratio = med["tree"] / med[args.rev]
    print(f"VGG-style step: {1e3 * med[args.rev]:.1f} -> {1e3 * med['tree']:.1f} ms "
          f"({ratio:.2f}x); same bits: {same}")  # fmt: skip
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"args": options, "pools": rows, "same_bits": same,
              "step_median_cpu_s": {k: round(v, 4) for k, v in med.items()},
              "step_ratio": round(ratio, 3)}  # fmt: skip
    if args.out:
        write_out(args.out, result)
    print(json.dumps(result))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
