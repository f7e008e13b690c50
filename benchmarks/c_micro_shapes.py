"""The C GEMM with other register-block (micro-kernel) shapes against the one it ships, on
the transformer workloads' product shapes, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_micro_shapes.py --shapes 6x4 8x3 24x1 --rounds 9

The shipped micro-kernel for this machine's instruction set (``kernels/gemm_micro.h``:
12 x 32 with AVX-512, 6 x 16 with AVX2 + FMA) is the baseline. Each variant ``RxV`` is the
same kernel written for R rows of packed A by V vectors of B (R x 16V floats with AVX-512,
R x 8V with AVX2): the kernels folder is copied, the instruction set's micro-kernel is
replaced by the generated one, and ``linalg.c`` is built with the backend's flags into a
library of its own. Every library's ``pe_gemm_f32`` then runs every product of
``c_gemm.SHAPES`` (BERT and LLaMA forward, input and weight gradients; the loss's
vocabulary tiles; one attention head's scores), the libraries in turn, round after round;
the median process CPU time of each gives GFLOP/s. Prints a table (each variant's rate
and its time against the baseline's) and, on the last line, one JSON object; ``--out``
writes the same object to a file. Only float; a target without AVX-512 or AVX2 has no
SIMD kernel to vary.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
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

# The instruction set's block in gemm_micro.h: (its first line, the line after it, the
# vector type, its lanes, load, broadcast of a[k * MR + r], multiply-add, store, zero).
_ISA = {
    "avx512": ("#if defined(PE_GEMM_ISA_AVX512)", "#elif defined(PE_GEMM_ISA_AVX2)",
               "__m512", 16, "_mm512_loadu_ps", "_mm512_set1_ps(a[k * {mr} + r])",
               "_mm512_fmadd_ps", "_mm512_storeu_ps", "_mm512_setzero_ps()"),
    "avx2": ("#elif defined(PE_GEMM_ISA_AVX2)", "#elif defined(PE_GEMM_ISA_NEON)",
             "__m256", 8, "_mm256_loadu_ps", "_mm256_broadcast_ss(a + k * {mr} + r)",
             "_mm256_fmadd_ps", "_mm256_storeu_ps", "_mm256_setzero_ps()"),
}  # fmt: skip


def _isa(flags: tuple[str, ...]) -> str | None:
    """The instruction set the backend's flags give the GEMM (the compiler's macros)."""
    out = subprocess.run(["cc", *flags, "-dM", "-E", "-x", "c", "/dev/null"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    if "__AVX512F__" in out:
        return "avx512"
    if "__AVX2__" in out and "__FMA__" in out:
        return "avx2"
    return None


def _micro(isa: str, mr: int, nv: int) -> str:
    """The micro-kernel for ``mr`` rows by ``nv`` vectors, as gemm_micro.h's contract has
    it (c = (load ? c : 0) + sum over k, every element's products in k order)."""
    first, _, vec, lanes, load, bcast, fma, store, zero = _ISA[isa]
    nr = nv * lanes
    return f"""{first}
#define PE_MR_F32 {mr}
#define PE_NR_F32 {nr}
static void pe_gemm_micro_simd_f32(long kc, const float *restrict a, const float *restrict b,
                                   float *restrict c, long ldc, int load) {{
    {vec} acc[{mr}][{nv}];
#pragma GCC unroll {mr}
    for (int r = 0; r < {mr}; r++)
#pragma GCC unroll {nv}
        for (int v = 0; v < {nv}; v++)
            acc[r][v] = load ? {load}(c + r * ldc + {lanes} * v) : {zero};
    for (long k = 0; k < kc; k++) {{
        {vec} bv[{nv}];
#pragma GCC unroll {nv}
        for (int v = 0; v < {nv}; v++) bv[v] = {load}(b + k * {nr} + {lanes} * v);
#pragma GCC unroll {mr}
        for (int r = 0; r < {mr}; r++) {{
            {vec} av = {bcast.format(mr=mr)};
#pragma GCC unroll {nv}
            for (int v = 0; v < {nv}; v++) acc[r][v] = {fma}(av, bv[v], acc[r][v]);
        }}
    }}
#pragma GCC unroll {mr}
    for (int r = 0; r < {mr}; r++)
#pragma GCC unroll {nv}
        for (int v = 0; v < {nv}; v++) {store}(c + r * ldc + {lanes} * v, acc[r][v]);
}}
"""


def _build(folder: Path, flags: tuple[str, ...], isa: str, shape: tuple[int, int] | None) -> Path:
    """``linalg.c`` and ``common.c`` from a copy of the kernels (with ``shape``'s
    micro-kernel in place of the shipped one) as a library in ``folder``."""
    kernels = folder / "kernels"
    shutil.copytree(KERNEL_DIR, kernels)
    if shape is not None:
        path = kernels / "gemm_micro.h"
        text = path.read_text()
        first, after = _ISA[isa][:2]
        start, end = text.find(first), text.find(after)
        if start < 0 or end < start:
            sys.exit(f"error: {path}: no '{first}' block to replace")
        path.write_text(text[:start] + _micro(isa, *shape) + text[end:])
    lib = folder / "libgemm.so"
    subprocess.run(["cc", *flags, "-shared", "-fPIC", "-std=c11", "-D_POSIX_C_SOURCE=200809L",
                    "-fno-math-errno", "-I", str(kernels), str(kernels / "linalg.c"),
                    str(kernels / "common.c"), "-o", str(lib), "-lm"], check=True)  # fmt: skip
    return lib


def _parse_shape(text: str) -> tuple[int, int]:
    try:
        rows, vectors = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want ROWSxVECTORS, e.g. 6x4") from None
    if not (1 <= rows <= 32 and 1 <= vectors <= 8 and rows * vectors <= 28):
        raise argparse.ArgumentTypeError(
            f"{text!r}: rows 1-32, vectors 1-8, at most 28 accumulators (32 registers)"
        )
    return rows, vectors


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", type=_parse_shape, default=["6x4", "8x3", "24x1"])
    parser.add_argument("--rounds", type=positive_int, default=9)
    parser.add_argument("--out", type=out_file, default=None, help="also write the JSON here")
    args = parser.parse_args()
    shapes = [s if isinstance(s, tuple) else _parse_shape(s) for s in args.shapes]
    flags = toolchain().flags
    isa = _isa(flags)
    if isa is None:
        print("error: no AVX-512 or AVX2 + FMA micro-kernel on this target to vary")
        return 2
    lanes = _ISA[isa][3]
    names = ["shipped", *(f"{r}x{v * lanes}" for r, v in shapes)]
    with tempfile.TemporaryDirectory(prefix="pe-micro-") as tmp:
        libs = []
        for name, shape in zip(names, [None, *shapes], strict=True):
            folder = Path(tmp) / name
            folder.mkdir()
            lib = declare_gemm(ctypes.CDLL(str(_build(folder, flags, isa, shape))))
            lib.pe_set_threads(1)
            libs.append(lib)
        runs = [[gemm_runner(lib, *shape[2:]) for lib in libs] for shape in SHAPES]
        seconds: list[list[list[float]]] = [[[] for _ in libs] for _ in SHAPES]
        for _ in range(args.rounds + 1):  # the first round warms up
            for s, per_lib in enumerate(runs):
                for v, run in enumerate(per_lib):
                    start = time.process_time()
                    run()
                    seconds[s][v].append(time.process_time() - start)
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
    summary = {"isa": isa, "rounds": args.rounds, "variants": names,
               "total_s": {n: round(float(t), 6) for n, t in total.items()},
               "command": "python " + " ".join(sys.argv), "rows": rows}  # fmt: skip
    print(
        "total seconds of one pass: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in total.items())
    )
    if args.out:
        write_out(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
