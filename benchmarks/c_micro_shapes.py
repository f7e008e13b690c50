"""The C GEMM under each of the build's micro-kernel shapes (``kernels/gemm_micro.h``), on
the transformer workloads' product shapes, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_micro_shapes.py --rounds 9 \
        --out benchmarks/results/c_micro_shapes-1thread.json

The build has three register-block shapes per instruction set (12x32, 24x16 and 6x64
floats with AVX-512; 6x16, 12x8 and 4x24 with AVX2 + FMA; 8x8, 12x8 and 4x16 with NEON;
4x8, 8x4 and 2x16 portable), the first the default; ``CBackend(tune=True)`` picks one per
node (``shape_tune.py``). ``linalg.c`` is built with the backend's flags (``--portable``:
the portable build) into a library, and its ``pe_gemm_f32`` runs every product of
``c_gemm.SHAPES`` (BERT and LLaMA forward, input and weight gradients; the loss's
vocabulary tiles; one attention head's scores) under each shape (``pe_gemm_shape``) in
turn, round after round, each timed run after an untimed one; the median process CPU time
of each gives GFLOP/s. Prints a table (each shape's rate, and the best) and, on the last
line, one JSON object; ``--out`` writes the same object to a file.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import out_file, write_out
from c_gemm import SHAPES, declare_gemm, gemm_runner

from pockengine.backends.c.driver import KERNEL_DIR, toolchain
from pockengine.finetune.arg_types import positive_int


def _build(folder: Path, flags: tuple[str, ...]) -> Path:
    """``linalg.c`` and ``common.c`` as a library in ``folder``."""
    lib = folder / "libgemm.so"
    subprocess.run(["cc", *flags, "-shared", "-fPIC", "-std=c11", "-D_POSIX_C_SOURCE=200809L",
                    "-fno-math-errno", "-I", str(KERNEL_DIR), str(KERNEL_DIR / "linalg.c"),
                    str(KERNEL_DIR / "common.c"), "-o", str(lib), "-lm"], check=True)  # fmt: skip
    return lib


def _shapes(lib: ctypes.CDLL) -> list[str]:
    rows, cols = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
    count = lib.pe_gemm_shape_list_f32(rows, cols, 8)
    return [f"{rows[i]}x{cols[i]}" for i in range(min(count, 8))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=positive_int, default=9)
    parser.add_argument("--portable", action="store_true", help="the portable build (-O3)")
    parser.add_argument("--out", type=out_file, default=None, help="also write the JSON here")
    args = parser.parse_args()
    flags = toolchain(True if args.portable else None).flags
    with tempfile.TemporaryDirectory(prefix="pe-micro-") as tmp:
        lib = declare_gemm(ctypes.CDLL(str(_build(Path(tmp), flags))))
        lib.pe_set_threads(1)
        names = _shapes(lib)
        shape = ctypes.c_int.in_dll(lib, "pe_gemm_shape")
        runs = [gemm_runner(lib, *product[2:]) for product in SHAPES]
        seconds: list[list[list[float]]] = [[[] for _ in names] for _ in SHAPES]
        for _ in range(args.rounds + 1):  # the first round warms up
            for s, run in enumerate(runs):
                for v in range(len(names)):
                    shape.value = v
                    run()  # untimed: the operands back in cache after the last product's
                    start = time.process_time()
                    run()
                    seconds[s][v].append(time.process_time() - start)
        shape.value = 0
    rows = []
    for (workload, product, m, n, k, ta, tb), times in zip(SHAPES, seconds, strict=True):
        medians = [statistics.median(t[1:]) for t in times]
        rates = {name: 2 * m * n * k / t / 1e9 for name, t in zip(names, medians, strict=True)}
        rows.append({"workload": workload, "product": product, "mnk": [m, n, k],
                     "op": ("T" if ta else "N") + ("T" if tb else "N"),
                     "gflops": rates})  # fmt: skip
    print(f"| workload | product | M x N x K | {' | '.join(names)} (GFLOP/s) | best |")
    print("|---|---|---|" + "---:|" * len(names) + "---|")
    for r in rows:
        rates = r["gflops"]
        best = max(rates, key=rates.get)
        cells = " | ".join(f"{rates[n]:.1f}" for n in names)
        print(f"| {r['workload']} | {r['product']} | {'x'.join(map(str, r['mnk']))} | {cells} "
              f"| {best} |")  # fmt: skip
    total = {n: sum(2 * np.prod(r["mnk"]) / r["gflops"][n] / 1e9 for r in rows) for n in names}
    best_each = sum(2 * np.prod(r["mnk"]) / max(r["gflops"].values()) / 1e9 for r in rows)
    summary = {"flags": list(flags), "rounds": args.rounds, "shapes": names,
               "total_s": {n: round(float(t), 6) for n, t in total.items()},
               "best_per_product_s": round(float(best_each), 6),
               "command": "python " + " ".join(sys.argv), "rows": rows}  # fmt: skip
    print(
        "total seconds of one pass: "
        + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in total.items())
        + f"; the best shape of each product: {best_each * 1e3:.2f} ms"
    )
    if args.out:
        write_out(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
