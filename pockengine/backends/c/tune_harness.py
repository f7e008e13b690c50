"""The timing harness: one small C library, built once per toolchain, that times one
convolution kernel on one geometry.

``pe_tune_time(op, kernel, dtype, geometry, reps)`` allocates the operands (64-byte
aligned, filled with values in [-1, 1)), runs the kernel once to warm the caches and
fault the pages in, then ``reps`` times, and returns the median of those runs in seconds
of process CPU time (-1 when the operands could not be allocated). ``pe_tune_times``
times a node's candidate kernels in turn on one set of operands, each warm-up run timed
so that a candidate clearly slower than the best so far is dropped at once. CPU time, not wall
time: on a shared machine it moves far less with the load (with several OpenMP threads
it counts the work of all of them, so it prefers the kernel that does the least work).
The harness links the same kernel objects as the step (``driver.build_library``, so it
is cached like a step).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

from pockengine.backends.c.conv_kernels import CONV_OPS, KERNEL_NAMES, ConvGeometry, implemented
from pockengine.backends.c.driver import build_library
from pockengine.backends.c.workspace import WORK_KERNELS
from pockengine.ir import DType

__all__ = ["CTYPE", "DTYPES", "SUFFIX", "gemm_shapes", "gemm_times", "harness_library",
           "harness_source", "harness_time", "harness_times", "shape_list_source"]  # fmt: skip

DTYPES = (DType.F32, DType.F64)
# each dtype's C type and the suffix of the kernels instantiated for it
CTYPE = {DType.F32: "float", DType.F64: "double"}
SUFFIX = {DType.F32: "f32", DType.F64: "f64"}

_ARGS = {
    "conv2d": "(const {t} *)a, (const {t} *)b, (const {t} *)c, ({t} *)out, g",
    "conv2d_input_grad": "(const {t} *)a, (const {t} *)b, ({t} *)out, g",
    "conv2d_weight_grad": "(const {t} *)a, (const {t} *)b, ({t} *)out, g",
}
_WORK = ", ({t} *)work"  # the working memory of the kernels that take it (workspace.py)

_BODY = r"""
static double pe_tune_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *pe_tune_alloc(size_t bytes, unsigned seed, int dt) {
    size_t size = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, size ? size : 64);
    if (!p) return NULL;
    unsigned s = seed * 2654435761u + 1u;
    size_t n = bytes / (dt ? sizeof(double) : sizeof(float));
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        double v = (double)(s >> 8) / 8388608.0 - 1.0;
        if (dt) ((double *)p)[i] = v; else ((float *)p)[i] = (float)v;
    }
    return p;
}

static int pe_tune_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The operands of op on geometry g (a, b, c, out, and the working memory of the kernels
 * that take it); 0 when one could not be allocated. Op PE_TUNE_GEMM is a product of
 * g = {M, N, K, ta, tb}: a is op(A), b op(B), out C. */
static int pe_tune_operands(int op, int dt, const long *g, void *p[5]) {
    size_t e = dt ? sizeof(double) : sizeof(float);
    if (op == PE_TUNE_GEMM) {
        p[0] = pe_tune_alloc((size_t)(g[0] * g[2]) * e, 1, dt);
        p[1] = pe_tune_alloc((size_t)(g[2] * g[1]) * e, 2, dt);
        p[2] = aligned_alloc(64, 64);
        p[3] = pe_tune_alloc((size_t)(g[0] * g[1]) * e, 4, dt);
        p[4] = aligned_alloc(64, 64);
        return p[0] && p[1] && p[2] && p[3] && p[4];
    }
    size_t nx = (size_t)(g[0] * g[1] * g[2] * g[3]);
    size_t nw = (size_t)(g[4] * (g[1] / g[15]) * g[5] * g[6]);
    size_t ny = (size_t)(g[0] * g[4] * g[7] * g[8]);
    size_t na = op == 1 ? ny : nx, nb = op == 0 ? nw : op == 1 ? nw : ny;
    size_t nc = op == 0 ? (size_t)g[4] : 1, nout = op == 0 ? ny : op == 1 ? nx : nw;
    p[0] = pe_tune_alloc(na * e, 1, dt);
    p[1] = pe_tune_alloc(nb * e, 2, dt);
    p[2] = pe_tune_alloc(nc * e, 3, dt);
    p[3] = pe_tune_alloc(nout * e, 4, dt);
    int wino = g[5] == 3 && g[6] == 3 && g[9] == 1 && g[10] == 1 && g[13] == 1 && g[14] == 1 &&
               g[15] == 1; /* where winograd4 is a candidate */
    size_t nwork = wino ? (size_t)pe_winograd4_work(op, g) * e : 0; /* written before read */
    p[4] = aligned_alloc(64, (nwork + 63) / 64 * 64 + 64);
    return p[0] && p[1] && p[2] && p[3] && p[4];
}

static void pe_tune_release(void *p[5]) {
    for (int i = 0; i < 5; i++) free(p[i]);
}

/* The median of reps timed runs (reps <= 64). */
static double pe_tune_median(int code, void *p[5], const long *g, int reps) {
    double times[64];
    for (int r = 0; r < reps; r++) {
        double t0 = pe_tune_now();
        pe_tune_call(code, p[0], p[1], p[2], p[3], g, p[4]);
        times[r] = pe_tune_now() - t0;
    }
    qsort(times, (size_t)reps, sizeof(double), pe_tune_cmp);
    return reps % 2 ? times[reps / 2] : 0.5 * (times[reps / 2 - 1] + times[reps / 2]);
}

double pe_tune_time(int op, int kernel, int dt, const long *g, int reps) {
    void *p[5];
    double result = -1;
    if (reps > 64) reps = 64;
    if (pe_tune_operands(op, dt, g, p) && reps > 0) {
        int code = (op * PE_TUNE_KERNELS + kernel) * 2 + dt;
        pe_tune_call(code, p[0], p[1], p[2], p[3], g, p[4]);
        result = pe_tune_median(code, p, g, reps);
    }
    pe_tune_release(p);
    return result;
}

/* kernels[0..n) of op on geometry g, on one set of operands, in turn, kernel i with the
 * GEMM's micro-kernel shape shapes[i] (each the default, 0, when shapes is NULL): a timed
 * warm-up run; seconds[i] = -2 when it took more than give_up times the best median so
 * far, else the median of an odd 3 to 9 runs, about budget seconds in all. Returns 0, or
 * -1 when the operands could not be allocated. */
int pe_tune_times(int op, int dt, const long *g, int n, const int *kernels, const int *shapes,
                  double budget, double give_up, double *seconds) {
    void *p[5];
    int ok = pe_tune_operands(op, dt, g, p);
    double best = -1;
    for (int i = 0; ok && i < n; i++) {
        int code = (op * PE_TUNE_KERNELS + kernels[i]) * 2 + dt;
        pe_gemm_shape = shapes ? shapes[i] : 0;
        double t0 = pe_tune_now();
        pe_tune_call(code, p[0], p[1], p[2], p[3], g, p[4]);
        double warm = pe_tune_now() - t0;
        if (best >= 0 && warm > give_up * best) {
            seconds[i] = -2;
            continue;
        }
        int reps = warm > 0 ? (int)(budget / warm) : 9;
        reps = reps < 3 ? 3 : reps > 9 ? 9 : reps | 1;
        seconds[i] = pe_tune_median(code, p, g, reps);
        if (best < 0 || seconds[i] < best) best = seconds[i];
    }
    pe_gemm_shape = 0;
    pe_tune_release(p);
    return ok ? 0 : -1;
}
"""


def harness_source(extra: tuple[str, ...] = (), extra_cases: tuple[str, ...] = (),
                   prelude: str = "", dtypes: tuple[DType, ...] = DTYPES) -> str:  # fmt: skip
    """The harness's C source: a switch over (op, kernel, dtype) codes, then the timer.
    ``extra`` names variants numbered after ``KERNEL_NAMES`` (the layout pass's ``nhwc``),
    whose ``case`` lines ``extra_cases`` holds, over functions ``prelude`` defines. Only the
    ``dtypes`` get cases (a trainer's harness: its step's, so the linker drops the kernels
    of the others); a code of another dtype times nothing."""
    cases = list(extra_cases)
    for d, dtype in enumerate(DTYPES):  # the product: op(A) and op(B) packed, ta and tb
        if dtype not in dtypes:
            continue
        sfx = SUFFIX[dtype]
        code = len(CONV_OPS) * (len(KERNEL_NAMES) + len(extra)) * 2 + d
        gemm = (f"pe_gemm_{sfx}(g[0], g[1], g[2], a, g[3] ? g[0] : g[2], (int)g[3], b, "
                f"g[4] ? g[2] : g[1], (int)g[4], out, g[1], 0)")  # fmt: skip
        cases.append(f"    case {code}: {gemm}; break;")
    for i, op in enumerate(CONV_OPS):
        for j, kernel in enumerate(KERNEL_NAMES):
            if not implemented(op, kernel):
                continue
            work = _WORK if kernel in WORK_KERNELS else ""
            for d, dtype in enumerate(DTYPES):
                if dtype not in dtypes:
                    continue
                sfx = SUFFIX[dtype]
                args = (_ARGS[op] + work).format(t=CTYPE[dtype])
                code = (i * (len(KERNEL_NAMES) + len(extra)) + j) * 2 + d
                cases.append(f"    case {code}: pe_{op}_{kernel}_{sfx}({args}); break;")
    head = [
        "/* Generated by pockengine: the convolution kernels' timing harness. */",
        "#include <stdlib.h>",
        "#include <time.h>",
        '#include "pe_kernels.h"',
        prelude,
        "",
        f"#define PE_TUNE_KERNELS {len(KERNEL_NAMES) + len(extra)}",
        f"#define PE_TUNE_GEMM {len(CONV_OPS)} /* the op number of a plain product */",
        "static void pe_tune_call(int code, void *a, void *b, void *c, void *out, const long *g,",
        "                         void *work) {",
        "    (void)c, (void)work;",
        "    switch (code) {",
        *cases,
        "    default: break;",
        "    }",
        "}",
    ]
    return "\n".join(head) + _BODY


def shape_list_source(dtypes: tuple[DType, ...] = DTYPES) -> str:
    """C's ``pe_tune_shape_list(dtype, rows, cols, max)``: the build's micro-kernel shapes
    for a dtype code (its index in ``DTYPES``), for ``dtypes`` only (0 for the others),
    so a trainer links the GEMM drivers of its step's dtypes alone."""
    cases = [f"    case {d}: return pe_gemm_shape_list_{SUFFIX[dtype]}(rows, cols, max);"
             for d, dtype in enumerate(DTYPES) if dtype in dtypes]  # fmt: skip
    head = "int pe_tune_shape_list(int dtype, int *rows, int *cols, int max) {"
    return "\n".join([head, "    switch (dtype) {", *cases, "    default: return 0;", "    }", "}"])


def _library(portable: bool | None) -> Any:
    return harness_library(harness_source(), portable)


@functools.cache
def harness_library(source: str, portable: bool | None) -> Any:
    """The harness library built from ``source`` (``harness_source``), its functions typed."""
    lib = ctypes.CDLL(str(build_library(source, portable)))
    c_int = ctypes.c_int
    lib.pe_tune_time.argtypes = [c_int, c_int, c_int, ctypes.POINTER(ctypes.c_long), c_int]
    lib.pe_tune_time.restype = ctypes.c_double
    ints = ctypes.POINTER(c_int)
    lib.pe_tune_times.argtypes = [c_int, c_int, ctypes.POINTER(ctypes.c_long), c_int, ints,
                                  ints, ctypes.c_double, ctypes.c_double,
                                  ctypes.POINTER(ctypes.c_double)]  # fmt: skip
    lib.pe_tune_times.restype = c_int
    lib.pe_set_threads.argtypes = [ctypes.c_int]
    for sfx in SUFFIX.values():
        getattr(lib, f"pe_gemm_shape_list_{sfx}").argtypes = [ints, ints, c_int]
    return lib


def harness_time(
    op: str,
    kernel: str,
    dtype: DType,
    g: ConvGeometry,
    reps: int,
    portable: bool | None,
    threads: int | None = None,
) -> float:
    """The median seconds of ``reps`` runs of ``kernel`` for ``op`` on ``g`` (after one
    warm-up run); -1 when the operands could not be allocated."""
    lib = _library(portable)
    if threads is not None:
        lib.pe_set_threads(threads)
    longs = g.longs()
    geometry = (ctypes.c_long * len(longs))(*longs)
    code = (CONV_OPS.index(op), KERNEL_NAMES.index(kernel), DTYPES.index(dtype))
    return float(lib.pe_tune_time(*code, geometry, reps))


def harness_times(
    op: str,
    kernels: list[str],
    dtype: DType,
    g: ConvGeometry,
    budget: float,
    give_up: float,
    portable: bool | None,
    threads: int | None = None,
    library: Any = None,
    codes: tuple[int, ...] | None = None,
    shapes: tuple[int, ...] | None = None,
) -> list[float]:
    """The median seconds of each of ``kernels`` for ``op`` on ``g``, timed in turn on one
    set of operands (``pe_tune_times``): after a warm-up run, an odd 3 to 9 runs of about
    ``budget`` seconds in all; inf for a kernel whose warm-up took more than ``give_up``
    times the best median before it, and for all when the operands could not be
    allocated. ``library`` and ``codes`` (each kernel's number in it): another harness
    (``harness_library``), whose extra variants ``kernels`` may name. ``shapes``: the
    GEMM's micro-kernel shape of each run (indices of ``gemm_shapes``; default 0)."""
    lib = library or _library(portable)
    if threads is not None:
        lib.pe_set_threads(threads)
    longs = g.longs()
    geometry = (ctypes.c_long * len(longs))(*longs)
    numbers = codes or tuple(KERNEL_NAMES.index(k) for k in kernels)
    codes_c = (ctypes.c_int * len(kernels))(*numbers)
    seconds = (ctypes.c_double * len(kernels))()
    op_code, dt = CONV_OPS.index(op), DTYPES.index(dtype)
    shapes_c = None if shapes is None else (ctypes.c_int * len(kernels))(*shapes)
    if lib.pe_tune_times(op_code, dt, geometry, len(kernels), codes_c, shapes_c, budget,
                         give_up, seconds):  # fmt: skip
        return [math.inf] * len(kernels)
    return [t if t >= 0 else math.inf for t in seconds]


def gemm_shapes(dtype: DType, portable: bool | None) -> tuple[str, ...]:
    """The GEMM's micro-kernel shapes in this build for ``dtype`` ("ROWSxCOLUMNS"), the
    default first; the index of one is what ``pe_gemm_shape`` takes."""
    lib = _library(portable)
    rows, cols = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
    sfx = SUFFIX[dtype]
    count = getattr(lib, f"pe_gemm_shape_list_{sfx}")(rows, cols, 8)
    return tuple(f"{rows[i]}x{cols[i]}" for i in range(min(count, 8)))


def gemm_times(
    dtype: DType,
    product: tuple[int, int, int, int, int],
    shapes: tuple[int, ...],
    budget: float,
    give_up: float,
    portable: bool | None,
    threads: int | None = None,
) -> list[float]:
    """The median seconds of the product ``(M, N, K, ta, tb)`` (``pe_gemm``) under each of
    the micro-kernel ``shapes`` (indices of ``gemm_shapes``), timed in turn on one set of
    operands as ``harness_times`` does."""
    lib = _library(portable)
    if threads is not None:
        lib.pe_set_threads(threads)
    geometry = (ctypes.c_long * 5)(*product)
    codes = (ctypes.c_int * len(shapes))(*([0] * len(shapes)))
    shapes_c = (ctypes.c_int * len(shapes))(*shapes)
    seconds = (ctypes.c_double * len(shapes))()
    if lib.pe_tune_times(len(CONV_OPS), DTYPES.index(dtype), geometry, len(shapes), codes,
                         shapes_c, budget, give_up, seconds):  # fmt: skip
        return [math.inf] * len(shapes)
    return [t if t >= 0 else math.inf for t in seconds]
