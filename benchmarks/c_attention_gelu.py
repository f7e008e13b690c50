"""The C backend's attention kernels and float GELU loops on BERT's shapes against ATen's,
and against the kernels of a git revision, in one process.

    OMP_NUM_THREADS=1 python benchmarks/c_attention_gelu.py --rev HEAD --rounds 21

BERT's benchmark shape: 8 sequences x 12 heads of 128 tokens x 32, q, k and v read as
the split heads of [8, 128, 12, 32] (strided, as the step reads them), a padding mask of
the last 28 keys; GELU (erf) on its FFN activation, [1024, 1536]. Timed in turn, round
after round (process CPU time, the median over ``--rounds`` after one warm-up round):
``pe_attention_f32`` and ``pe_attention_grad_f32`` against ATen's
``_scaled_dot_product_flash_attention_for_cpu`` and its backward (what the torch backend
calls), and the generated step's GELU and GELU-gradient loops (``pe_gelu_f32``,
``pe_gelu_grad_f32`` over the tensor, as ``lower_ew.py`` writes them) against
``aten::gelu.out`` and ``aten::gelu_backward.grad_input`` (into a buffer, as the C loops
write theirs). With ``--rev``, the same C
functions built from that revision's ``kernels/`` too. One torch thread (``--threads``
sets both). Prints a table and, on the last line, one JSON object (``--out`` writes it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _harness import extract_kernels, out_file, write_out

from pockengine.finetune.arg_types import positive_int

B, H, L, E = 8, 12, 128, 32
ROWS, COLS = 1024, 1536

# The loops as the generated step writes them, in a library of their own.
_LOOPS = """#include "pe_kernels.h"
#include "elementwise.h"
void bench_gelu(const float *x, float *y, long n) {
    for (long i = 0; i < n; i++) y[i] = pe_gelu_f32(x[i], 0);
}
void bench_gelu_grad(const float *gz, const float *x, float *gx, long n) {
    for (long i = 0; i < n; i++) gx[i] = pe_gelu_grad_f32(gz[i], x[i], 0);
}
"""


def _library(kernels: Path | None) -> ctypes.CDLL:
    """The kernels (of ``kernels``, else the working tree's) with the GELU loops."""
    from pockengine.backends.c import driver

    saved = driver.KERNEL_DIR
    if kernels is not None:
        driver.KERNEL_DIR = kernels
    try:
        lib = ctypes.CDLL(str(driver.build_library(_LOOPS)))
    finally:
        driver.KERNEL_DIR = saved
    lib.pe_set_threads.argtypes = [ctypes.c_int]
    return lib


class _Operands:
    """One set of inputs and outputs, shared by every engine."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = (rng.standard_normal((B, L, H, E), dtype=np.float32)
                                  for _ in range(3))  # fmt: skip
        self.go = rng.standard_normal((B, H, L, E), dtype=np.float32)
        mask = np.zeros((B, 1, 1, L), np.float32)
        mask[..., L - 28 :] = -np.inf
        self.mask = np.ascontiguousarray(np.broadcast_to(mask, (B, 1, L, L)))
        self.out = np.empty((B, H, L, E), np.float32)
        self.lse = np.empty((B, H, L), np.float32)
        self.grads = [np.empty((B, H, L, E), np.float32) for _ in range(3)]
        self.x = rng.standard_normal((ROWS, COLS), dtype=np.float32) * 2
        self.gz = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        self.y = np.empty_like(self.x)
        split = (L * H * E, E, H * E)  # batch, head and row strides of [B, L, H, E]
        self.geom = (ctypes.c_long * 22)(B, H, L, L, E, E, L * L, 0, L, 1, *split, *split,
                                         *split, H * L * E, L * E, E)  # fmt: skip


def _c(lib: ctypes.CDLL, o: _Operands) -> dict[str, Callable[[], None]]:
    p, scale = ctypes.c_void_p, ctypes.c_double(E**-0.5)
    q, k, v, mask = (p(a.ctypes.data) for a in (o.q, o.k, o.v, o.mask))
    out, lse, go = p(o.out.ctypes.data), p(o.lse.ctypes.data), p(o.go.ctypes.data)
    gq, gk, gv = (p(g.ctypes.data) for g in o.grads)
    x, gz, y, n = p(o.x.ctypes.data), p(o.gz.ctypes.data), p(o.y.ctypes.data), ROWS * COLS
    return {
        "attention": lambda: lib.pe_attention_f32(q, k, v, mask, out, lse, o.geom, scale, 0),
        "attention_grad": lambda: lib.pe_attention_grad_f32(
            go, q, k, v, mask, out, lse, gq, gk, gv, o.geom, scale, 0
        ),
        "gelu": lambda: lib.bench_gelu(x, y, ctypes.c_long(n)),
        "gelu_grad": lambda: lib.bench_gelu_grad(gz, x, y, ctypes.c_long(n)),
    }


def _aten(o: _Operands) -> dict[str, Callable[[], None]]:
    import torch

    q, k, v = (torch.from_numpy(a).transpose(1, 2) for a in (o.q, o.k, o.v))
    mask, go = torch.from_numpy(o.mask), torch.from_numpy(o.go)
    x, gz = torch.from_numpy(o.x), torch.from_numpy(o.gz)
    y = torch.empty_like(x)  # GELU's into a buffer, as the C loops write theirs
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = fwd(q, k, v, 0.0, False, attn_mask=mask, scale=E**-0.5)
    return {
        "attention": lambda: fwd(q, k, v, 0.0, False, attn_mask=mask, scale=E**-0.5),
        "attention_grad": lambda: bwd(
            go, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=E**-0.5
        ),
        "gelu": lambda: torch.ops.aten.gelu.out(x, out=y),
        "gelu_grad": lambda: torch.ops.aten.gelu_backward.grad_input(gz, x, grad_input=y),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", default=None, help="also time this revision's kernels")
    parser.add_argument("--rounds", type=positive_int, default=21)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", type=out_file, default=None, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    operands = _Operands()
    engines: dict[str, dict[str, Callable[[], None]]] = {}
    with tempfile.TemporaryDirectory(prefix="pe-kernels-") as tmp:
        libs = {"c": _library(None)}
        if args.rev:
            extract_kernels(args.rev, Path(tmp))
            libs[f"c@{args.rev}"] = _library(Path(tmp))
        for name, lib in libs.items():
            lib.pe_set_threads(args.threads)
            engines[name] = _c(lib, operands)
    engines["aten"] = _aten(operands)
    seconds: dict[str, dict[str, list[float]]] = {
        e: {k: [] for k in fs} for e, fs in engines.items()
    }
    for _ in range(args.rounds + 1):  # the first round warms up
        for kernel in engines["aten"]:
            for engine, fns in engines.items():
                start = time.process_time()
                fns[kernel]()
                seconds[engine][kernel].append(time.process_time() - start)
    ms: dict[str, dict[str, float]] = {
        e: {k: statistics.median(t[1:]) * 1e3 for k, t in per.items()} for e, per in seconds.items()
    }
    names = list(engines)
    print(f"| kernel | {' | '.join(f'{n} (ms)' for n in names)} | c / aten |")
    print("|---|" + "---:|" * (len(names) + 1))
    for kernel in engines["aten"]:
        cells = " | ".join(f"{ms[n][kernel]:.3f}" for n in names)
        print(f"| {kernel} | {cells} | {ms['c'][kernel] / ms['aten'][kernel]:.2f} |")
    result: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "median_ms": ms,
                              "command": "python " + " ".join(sys.argv)}  # fmt: skip
    if args.out:
        write_out(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
