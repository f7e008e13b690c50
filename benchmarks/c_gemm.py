"""The C backend's GEMM (kernels/linalg.c) on the transformer workloads' product shapes
against torch's, at the same thread count, in one process.

    python benchmarks/c_gemm.py --threads 1 --rounds 15

For every forward and backward product of the BERT (hidden 384, FFN 1536, 8 x 128
tokens) and LLaMA (hidden 512, FFN 1376, vocabulary 32000, 256 tokens) benchmark
workloads, ``pe_gemm_f32`` (transposed operands read in place, as the backward calls
it) and ``torch.mm`` on the same operands (transposed views) are timed in turn, round
after round; the median of each gives GFLOP/s. The probe is ``torch.mm`` of two 2048 x
2048 matrices, timed in the same rounds: the rate this machine's BLAS reaches at this
thread count. Then the low-bit products (``pe_qgemm_f32``: LLaMA's FFN up weight as
GGUF Q8_0, Q4_1 and Q4_0 blocks, dequantised as the panels are packed) against the float
GEMM on the same shape. With one thread the clock is the process's CPU time (on a shared machine it
moves less than wall time); with more, wall time. Prints a table and, on the last line,
one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# (workload, product, M, N, K, A transposed, B transposed): y = x W (forward), the input
# gradient dY W^T and the weight gradient X^T dY (backward), per linear layer.
_BERT, _LLAMA = (1024, 384, 1536), (256, 512, 1376)
SHAPES: list[tuple[str, str, int, int, int, int, int]] = []
for _name, (_t, _h, _f) in (("bert", _BERT), ("llama", _LLAMA)):
    for _layer, (_k, _n) in (("attn proj", (_h, _h)), ("ffn up", (_h, _f)), ("ffn down", (_f, _h))):
        SHAPES.append((_name, f"{_layer} fwd", _t, _n, _k, 0, 0))
        SHAPES.append((_name, f"{_layer} dX", _t, _k, _n, 0, 1))
        SHAPES.append((_name, f"{_layer} dW", _k, _n, _t, 1, 0))
SHAPES += [
    ("llama", "vocab tile fwd", 128, 128, 512, 0, 1),  # the fused loss's 128 x 128 tiles
    ("llama", "vocab tile dX", 128, 512, 128, 0, 0),
    ("llama", "vocab tile dW", 128, 512, 128, 1, 0),
    ("bert", "attn scores", 64, 128, 32, 0, 1),  # per head: queries x keys
    ("llama", "attn scores", 64, 256, 64, 0, 1),
]

# Low-bit frozen weights (pe_qgemm_f32: the panel dequantised as it is packed) against the
# float GEMM on the same shape: LLaMA's FFN up weight [1376, 512] in GGUF's blocks of 32
# with f16 scales, forward x W^T and input gradient dY W, at 256 rows and at 32.
_SCHEMES = {"Q8_0": 0, "Q4_1": 1, "Q4_0": 2}  # pe_quant.h: int8, int4 with offsets, int4_sym
LOWBIT = [
    (scheme, what, m, transpose)
    for m in (256, 32)
    for what, transpose in (("ffn up fwd", 1), ("ffn up dX", 0))
    for scheme in _SCHEMES
]


class _QMat(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("scheme", ctypes.c_int),
                ("half_scales", ctypes.c_int), ("group", ctypes.c_long),
                ("rows", ctypes.c_long), ("cols", ctypes.c_long)]  # fmt: skip


def _library() -> ctypes.CDLL:
    from pockengine.backends.c.driver import build_library

    lib = declare_gemm(ctypes.CDLL(str(build_library("/* the kernels alone */\n"))))
    p, n = ctypes.c_void_p, ctypes.c_long
    q = lib.pe_qgemm_f32
    q.argtypes = [n, n, n, p, n, ctypes.POINTER(_QMat), n, ctypes.c_int, p, n, ctypes.c_int]
    return lib


def declare_gemm(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with the argument types of ``pe_set_threads`` and ``pe_gemm_f32``."""
    lib.pe_set_threads.argtypes = [ctypes.c_int]
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.pe_gemm_f32.argtypes = [n, n, n, p, n, ctypes.c_int, p, n, ctypes.c_int, p, n,
                                ctypes.c_int]  # fmt: skip
    return lib


def gemm_runner(lib: ctypes.CDLL, m: int, n: int, k: int, ta: int, tb: int) -> Callable[[], None]:
    """A call of ``lib``'s ``pe_gemm_f32`` on random operands of one product's shape."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    args = (m, n, k, a.ctypes.data, a.shape[1], ta, b.ctypes.data, b.shape[1], tb,
            c.ctypes.data, n, 0)  # fmt: skip
    keep = (a, b, c)

    def run() -> None:
        lib.pe_gemm_f32(*args)
        assert keep

    return run


def _lowbit(lib: ctypes.CDLL, scheme: str, m: int, transpose: int) -> Callable[[], None]:
    rows, cols, group = _LLAMA[2], _LLAMA[1], 32
    rng = np.random.default_rng(0)
    per_row = cols if scheme == "Q8_0" else cols // 2
    codes = rng.integers(0, 256, (rows, per_row), dtype=np.uint8)
    scales = (rng.random(rows * cols // group) * 0.01 + 0.001).astype(np.float16)
    offsets = (-rng.random(rows * cols // group) * 0.05).astype(np.float16)
    w = _QMat(codes.ctypes.data, scales.ctypes.data, offsets.ctypes.data, _SCHEMES[scheme], 1,
              group, rows, cols)  # fmt: skip
    n, k = (rows, cols) if transpose else (cols, rows)
    x = rng.standard_normal((m, k), dtype=np.float32)
    z = np.empty((m, n), np.float32)
    keep = (codes, scales, offsets, x, z)
    args = (m, n, k, x.ctypes.data, k, ctypes.byref(w), 0, transpose, z.ctypes.data, n, 0)

    def run() -> None:
        lib.pe_qgemm_f32(*args)
        assert keep

    return run


def _torch(m: int, n: int, k: int, ta: int, tb: int) -> Callable[[], None]:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn((k, m) if ta else (m, k), generator=g)
    b = torch.randn((n, k) if tb else (k, n), generator=g)
    a, b = (a.t() if ta else a), (b.t() if tb else b)
    out = torch.empty(m, n)

    def run() -> None:
        torch.mm(a, b, out=out)

    return run


def _clock(name: str) -> Callable[[], float]:
    return time.perf_counter if name == "wall" else time.process_time


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default=None,
        help="process CPU time (default with one thread: a loaded machine moves it less) "
        "or wall time (default with more)",
    )  # fmt: skip
    parser.add_argument(
        "--only", default="", help="time only the shapes whose 'workload product' holds this"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    lib = _library()
    lib.pe_set_threads(args.threads)
    args.clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    clock = _clock(args.clock)
    shapes = [s for s in SHAPES if args.only in f"{s[0]} {s[1]}"]
    cases: list[tuple[Callable[[], None], Callable[[], None]]] = [
        (gemm_runner(lib, m, n, k, ta, tb), _torch(m, n, k, ta, tb))
        for _, _, m, n, k, ta, tb in shapes
    ]
    lowbit = [r for r in LOWBIT if args.only in f"lowbit {r[1]}"]
    for scheme, _what, m, transpose in lowbit:  # against the float GEMM on the same shape
        n, k = (_LLAMA[2], _LLAMA[1]) if transpose else (_LLAMA[1], _LLAMA[2])
        cases.append((_lowbit(lib, scheme, m, transpose), gemm_runner(lib, m, n, k, 0, transpose)))
    probe = _torch(2048, 2048, 2048, 0, 0)
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in cases]
    probe_times: list[float] = []
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        t = clock()
        probe()
        probe_times.append(clock() - t)
        for (c_fn, torch_fn), (mine, torch_t) in zip(cases, times, strict=True):
            for fn, into in ((c_fn, mine), (torch_fn, torch_t)):
                t = clock()
                fn()
                into.append(clock() - t)
    probe_rate = 2 * 2048**3 / statistics.median(probe_times[1:]) / 1e9
    rows: list[dict[str, Any]] = []
    print(f"probe: torch.mm 2048^3 at {args.threads} thread(s): {probe_rate:.1f} GFLOP/s")
    if shapes:
        print(f"{'workload':8} {'product':16} {'M x N x K':>18} {'op':>5} {'C':>7} {'torch':>7} "
              f"{'C/probe':>8} {'C/torch':>8}")  # fmt: skip
    for (work, what, m, n, k, ta, tb), (mine, torch_t) in zip(shapes, times, strict=False):
        flops = 2 * m * n * k
        rate = flops / statistics.median(mine[1:]) / 1e9
        theirs = flops / statistics.median(torch_t[1:]) / 1e9
        op = ("T" if ta else "N") + ("T" if tb else "N")
        print(f"{work:8} {what:16} {f'{m}x{n}x{k}':>18} {op:>5} {rate:7.1f} {theirs:7.1f} "
              f"{rate / probe_rate:8.2f} {rate / theirs:8.2f}")  # fmt: skip
        rows.append({"workload": work, "product": what, "m": m, "n": n, "k": k, "op": op,
                     "c_gflops": round(rate, 2), "torch_gflops": round(theirs, 2)})  # fmt: skip
    ratios = [r["c_gflops"] / probe_rate for r in rows]
    if ratios:
        print(f"C / probe: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}")
    low_rows = _lowbit_table(lowbit, times[len(shapes) :])
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(json.dumps({"threads": args.threads, "clock": args.clock, "rounds": args.rounds,
                      "probe_gflops": round(probe_rate, 2), "shapes": rows, "lowbit": low_rows,
                      "loadavg": os.getloadavg()[0]}))  # fmt: skip
    return 0


def _lowbit_table(
    lowbit: list[tuple[str, str, int, int]], times: list[tuple[list[float], list[float]]]
) -> list[dict[str, Any]]:
    """Prints the low-bit rows (time against the float GEMM's) and returns them."""
    rows: list[dict[str, Any]] = []
    if lowbit:
        print(f"{'low-bit':8} {'product':16} {'M x N x K':>18} {'C':>7} {'float C':>7} "
              f"{'time/float':>10}")  # fmt: skip
    for (scheme, what, m, transpose), (mine, flt) in zip(lowbit, times, strict=True):
        n, k = (_LLAMA[2], _LLAMA[1]) if transpose else (_LLAMA[1], _LLAMA[2])
        ours, theirs = statistics.median(mine[1:]), statistics.median(flt[1:])
        flops = 2 * m * n * k
        print(f"{scheme:8} {what:16} {f'{m}x{n}x{k}':>18} {flops / ours / 1e9:7.1f} "
              f"{flops / theirs / 1e9:7.1f} {ours / theirs:10.2f}")  # fmt: skip
        rows.append({"scheme": scheme, "product": what, "m": m, "n": n, "k": k,
                     "c_gflops": round(flops / ours / 1e9, 2),
                     "float_gflops": round(flops / theirs / 1e9, 2),
                     "time_over_float": round(ours / theirs, 3)})  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
