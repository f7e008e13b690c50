"""Each convolution's layout chosen by measurement (``CBackend(tune=True)``).

For every conv node that has a kernel in another layout (``layout.layout_candidates``),
the candidates are timed in one harness call on one set of NCHW operands: the node's NCHW
kernel (the measured choice of ``tune.choose_kernels``), ``nhwc`` and, for depthwise
convolutions, ``nchwc`` (the channel-blocked ``layout.blocked_layout``). Each of the last
two converts the node's activations, runs its kernel and converts its activation result
back, so the conversions' cost is counted in full (in the step, a layer's forward
convolution and weight gradient share one conversion of x, so this is the pessimistic
side). The fastest of them is kept where it takes less than ``MARGIN`` (0.9) of the NCHW
kernel's time. The choices are cached in ``conv-layouts.json`` beside the kernel table,
keyed and validated the same way (``tune.table_key``). A node whose kernels
``tune.choose_kernels`` measured has its layout candidates timed in that same harness call
(``layout_beside``; the NCHW kernel is then not timed again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pockengine.backends.c import tune, tune_harness
from pockengine.backends.c.conv_kernels import (
    CONV_OPS,
    KERNEL_NAMES,
    ConvGeometry,
    conv_geometry,
    node_kernel,
)
from pockengine.backends.c.driver import cache_dir, toolchain
from pockengine.backends.c.layout import NHWC, blocked_layout, layout_candidates
from pockengine.ir import DType, Graph, Node
from pockengine.plan.report import KernelChoice

__all__ = [
    "BLOCKED_KERNEL",
    "CACHE_NAME",
    "LAYOUT_KERNELS",
    "MARGIN",
    "NHWC_KERNEL",
    "choose_layouts",
    "layout_beside",
    "layout_harness_source",
    "layout_of",
    "measure_layouts",
    "merge_choices",
]

CACHE_NAME = "conv-layouts.json"
NHWC_KERNEL = "nhwc"  # the candidates' names in the report and the table
BLOCKED_KERNEL = "nchwc"
LAYOUT_KERNELS = (NHWC_KERNEL, BLOCKED_KERNEL)
_NAMES = (*KERNEL_NAMES, *LAYOUT_KERNELS)
_CODES = {NHWC_KERNEL: len(KERNEL_NAMES), BLOCKED_KERNEL: len(KERNEL_NAMES) + 1}  # harness numbers
# NHWC must take less than this fraction of NCHW's time: a near tie is within the timing's
# noise on a loaded machine, and each NHWC node adds conversions and their buffers
MARGIN = 0.9

# The nhwc candidates: convert in, compute in NHWC, convert out (g: conv.c's geometry).
_PRELUDE = r"""
static void *pe_lt_scratch[2];
static size_t pe_lt_bytes[2];
static void *pe_lt_buffer(int i, size_t bytes) {
    if (bytes > pe_lt_bytes[i]) {
        free(pe_lt_scratch[i]);
        pe_lt_scratch[i] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        pe_lt_bytes[i] = pe_lt_scratch[i] ? bytes : 0;
    }
    return pe_lt_scratch[i];
}
"""

_TIMED = r"""
static void pe_lt_conv2d_{S}(const {T} *x, const {T} *w, const {T} *b, {T} *y, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *xs = pe_lt_buffer(0, N * C * H * W * sizeof({T}));
    {T} *ys = pe_lt_buffer(1, N * O * OH * OW * sizeof({T}));
    if (!xs || !ys) return;
    pe_layout_convert_{S}(x, xs, N, C, H, W, 0, -1);
    if (g[15] == 1) {
        pe_gemm_{S}(N * H * W, O, C, xs, C, 0, w, C, 1, ys, O, 0);
        for (long i = 0; i < N * H * W; i++)
            for (long j = 0; j < O; j++) ys[i * O + j] += b[j];
    } else {
        pe_conv2d_nhwc_depthwise_{S}(xs, w, b, ys, g);
    }
    pe_layout_convert_{S}(ys, y, N, O, OH, OW, -1, 0);
}

static void pe_lt_conv2d_input_grad_{S}(const {T} *gy, const {T} *w, {T} *gx, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *gys = pe_lt_buffer(0, N * O * OH * OW * sizeof({T}));
    {T} *gxs = pe_lt_buffer(1, N * C * H * W * sizeof({T}));
    if (!gys || !gxs) return;
    pe_layout_convert_{S}(gy, gys, N, O, OH, OW, 0, -1);
    if (g[15] == 1)
        pe_gemm_{S}(N * H * W, C, O, gys, O, 0, w, C, 0, gxs, C, 0);
    else
        pe_conv2d_nhwc_input_grad_depthwise_{S}(gys, w, gxs, g);
    pe_layout_convert_{S}(gxs, gx, N, C, H, W, -1, 0);
}

static void pe_lt_conv2d_weight_grad_{S}(const {T} *x, const {T} *gy, {T} *gw, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *xs = pe_lt_buffer(0, N * C * H * W * sizeof({T}));
    {T} *gys = pe_lt_buffer(1, N * O * OH * OW * sizeof({T}));
    if (!xs || !gys) return;
    pe_layout_convert_{S}(x, xs, N, C, H, W, 0, -1);
    pe_layout_convert_{S}(gy, gys, N, O, OH, OW, 0, -1);
    if (g[15] == 1)
        pe_gemm_{S}(O, C, N * H * W, gys, O, 1, xs, C, 0, gw, C, 0);
    else
        pe_conv2d_nhwc_weight_grad_depthwise_{S}(xs, gys, gw, g);
}
"""

# The nchwc candidates (depthwise only): the same around the NCHW{B}c kernels, B channels
# a cache line (layout.blocked_layout)
_TIMED_BLOCKED = r"""
#define PE_LT_BLOCK_{S} ((int)(64 / sizeof({T})))
static long pe_lt_blocked_{S}(long N, long C, long HW) {
    long B = PE_LT_BLOCK_{S};
    return N * ((C + B - 1) / B) * B * HW;
}

static void pe_lb_conv2d_{S}(const {T} *x, const {T} *w, const {T} *b, {T} *y, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *xs = pe_lt_buffer(0, pe_lt_blocked_{S}(N, C, H * W) * sizeof({T}));
    {T} *ys = pe_lt_buffer(1, pe_lt_blocked_{S}(N, O, OH * OW) * sizeof({T}));
    if (!xs || !ys) return;
    pe_layout_convert_{S}(x, xs, N, C, H, W, 0, PE_LT_BLOCK_{S});
    pe_conv2d_nchwc_depthwise_{S}(xs, w, b, ys, g, PE_LT_BLOCK_{S});
    pe_layout_convert_{S}(ys, y, N, O, OH, OW, PE_LT_BLOCK_{S}, 0);
}

static void pe_lb_conv2d_input_grad_{S}(const {T} *gy, const {T} *w, {T} *gx, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *gys = pe_lt_buffer(0, pe_lt_blocked_{S}(N, O, OH * OW) * sizeof({T}));
    {T} *gxs = pe_lt_buffer(1, pe_lt_blocked_{S}(N, C, H * W) * sizeof({T}));
    if (!gys || !gxs) return;
    pe_layout_convert_{S}(gy, gys, N, O, OH, OW, 0, PE_LT_BLOCK_{S});
    pe_conv2d_nchwc_input_grad_depthwise_{S}(gys, w, gxs, g, PE_LT_BLOCK_{S});
    pe_layout_convert_{S}(gxs, gx, N, C, H, W, PE_LT_BLOCK_{S}, 0);
}

static void pe_lb_conv2d_weight_grad_{S}(const {T} *x, const {T} *gy, {T} *gw, const long *g) {
    long N = g[0], C = g[1], H = g[2], W = g[3], O = g[4], OH = g[7], OW = g[8];
    {T} *xs = pe_lt_buffer(0, pe_lt_blocked_{S}(N, C, H * W) * sizeof({T}));
    {T} *gys = pe_lt_buffer(1, pe_lt_blocked_{S}(N, O, OH * OW) * sizeof({T}));
    if (!xs || !gys) return;
    pe_layout_convert_{S}(x, xs, N, C, H, W, 0, PE_LT_BLOCK_{S});
    pe_layout_convert_{S}(gy, gys, N, O, OH, OW, 0, PE_LT_BLOCK_{S});
    pe_conv2d_nchwc_weight_grad_depthwise_{S}(xs, gys, gw, g, PE_LT_BLOCK_{S});
}
"""

_ARGS = {
    "conv2d": "(const {T} *)a, (const {T} *)b, (const {T} *)c, ({T} *)out, g",
    "conv2d_input_grad": "(const {T} *)a, (const {T} *)b, ({T} *)out, g",
    "conv2d_weight_grad": "(const {T} *)a, (const {T} *)b, ({T} *)out, g",
}


def layout_harness_source(dtypes: tuple[DType, ...] = tune_harness.DTYPES) -> str:
    """The timing harness with the ``nhwc`` and ``nchwc`` variants (kernel numbers
    ``len(KERNEL_NAMES)`` and one more), for ``dtypes`` (``harness_source``)."""
    prelude = _PRELUDE + "".join(
        (_TIMED + _TIMED_BLOCKED)
        .replace("{S}", tune_harness.SUFFIX[d])
        .replace("{T}", tune_harness.CTYPE[d])
        for d in tune_harness.DTYPES
        if d in dtypes
    )
    cases = []
    for i, op in enumerate(CONV_OPS):
        for d, dtype in enumerate(tune_harness.DTYPES):
            if dtype not in dtypes:
                continue
            s, t = tune_harness.SUFFIX[dtype], tune_harness.CTYPE[dtype]
            args = _ARGS[op].replace("{T}", t)
            for variant, prefix in ((NHWC_KERNEL, "pe_lt"), (BLOCKED_KERNEL, "pe_lb")):
                code = (i * len(_NAMES) + _CODES[variant]) * 2 + d
                cases.append(f"    case {code}: {prefix}_{op}_{s}({args}); break;")
    return tune_harness.harness_source(LAYOUT_KERNELS, tuple(cases), prelude, dtypes)


def _variants(node: Node) -> tuple[str, ...]:
    """The layout candidates of ``node`` by their kernel names (``nhwc``, ``nchwc``)."""
    return tuple(NHWC_KERNEL if c == NHWC else BLOCKED_KERNEL for c in layout_candidates(node))


def layout_of(kernel: str, dtype: DType) -> str | None:
    """The layout a node whose choice is ``kernel`` takes: NHWC, the blocked layout of
    ``dtype``, or None (an NCHW kernel)."""
    if kernel == NHWC_KERNEL:
        return NHWC
    return blocked_layout(dtype) if kernel == BLOCKED_KERNEL else None


def layout_beside(portable: bool | None) -> tune.Beside:
    """The layout candidates as variants ``tune.choose_kernels`` times beside a node's
    NCHW kernels, in this module's harness (which has them all)."""

    def library() -> Any:
        return tune_harness.harness_library(layout_harness_source(), portable)

    codes = tuple(_CODES[v] for v in LAYOUT_KERNELS)
    return tune.Beside(LAYOUT_KERNELS, library, codes, _variants)


def measure_layouts(
    op: str,
    nchw_kernel: str,
    dtype: DType,
    g: ConvGeometry,
    portable: bool | None,
    threads: int | None,
    timed: Mapping[str, float] | None = None,
    variants: tuple[str, ...] = (NHWC_KERNEL,),
) -> dict[str, float]:
    """The median seconds of ``nchw_kernel`` and of the layout candidates ``variants`` on
    ``g``, timed in turn on one set of operands (inf for one that could not be timed);
    ``timed``: all already taken (``layout_beside``), returned as they are."""
    if timed is not None:
        return dict(timed)
    library = tune_harness.harness_library(layout_harness_source(), portable)
    kernels = [nchw_kernel, *variants]
    codes = (KERNEL_NAMES.index(nchw_kernel), *(_CODES[v] for v in variants))
    seconds = tune_harness.harness_times(op, kernels, dtype, g, 0.02, 3.0, portable, threads,
                                         library, codes)  # fmt: skip
    return dict(zip(kernels, seconds, strict=True))


def _entry(
    seconds: Mapping[str, float], nchw_kernel: str, variants: tuple[str, ...]
) -> dict[str, Any]:
    timed = {k: v for k, v in seconds.items() if math.isfinite(v) and k in (nchw_kernel, *variants)}
    if nchw_kernel not in timed:  # NCHW unmeasured: keep it
        return {"kernel": nchw_kernel, "seconds": {nchw_kernel: 0.0}}
    best = min(variants, key=lambda k: timed.get(k, math.inf))
    kernel = best if timed.get(best, math.inf) < MARGIN * timed[nchw_kernel] else nchw_kernel
    return {"kernel": kernel, "seconds": timed}


def choose_layouts(
    graph: Graph,
    kernels: Mapping[str, str],
    portable: bool | None = None,
    threads: int | None = None,
    timed: Mapping[str, Mapping[str, float]] | None = None,
) -> list[KernelChoice]:
    """The measured (or cached) layout of each conv node of ``graph`` that has kernels in
    other layouts: kernel ``nhwc`` or ``nchwc`` where one won (``layout_of`` names its
    layout), else the node's NCHW kernel (``kernels`` by first output name, else the
    rule's; ``timed`` by output name: times already taken, ``tune.choose_kernels``'
    ``beside_times``). The table under the cache dir gains what was measured."""
    path = cache_dir() / CACHE_NAME
    table, dirty = tune.read_table(path, names=_NAMES)
    tc_key = toolchain(portable).key
    fresh: dict[str, Any] = {}
    choices = []
    for node in graph.nodes:
        variants = _variants(node)
        if not variants:
            continue
        g = conv_geometry(node)
        out = node.outputs[0]
        nchw = node_kernel(node, g, kernels)
        key = tune.table_key(node.op, out.dtype, g, tc_key, threads, (nchw, *variants))
        cached = key not in fresh and key in table and table[key]["kernel"] in (nchw, *variants)
        if cached:
            entry = table[key]
        elif key not in fresh:
            already = (timed or {}).get(out.name)
            complete = already is not None and {nchw, *variants} <= already.keys()
            seconds = measure_layouts(node.op, nchw, out.dtype, g, portable, threads,
                                      already if complete else None, variants)  # fmt: skip
            entry = fresh[key] = _entry(seconds, nchw, variants)
        else:
            entry = fresh[key]
        choices.append(
            KernelChoice(node.op, out.name, entry["kernel"], dict(entry["seconds"]), cached)
        )
    if fresh or dirty:
        tune.write_table(path, {**table, **fresh}, names=_NAMES)
    return choices


def merge_choices(kernels: list[KernelChoice], layouts: list[KernelChoice]) -> list[KernelChoice]:
    """One choice a node for the report: the kernel choice with the layout candidates'
    times added (its NCHW kernel's time as the layout measurement took it), or the layout
    choice where the node has no kernel choice; in the graph's order."""
    by_layout = {c.output: c for c in layouts}
    merged = []
    for choice in kernels:
        layout = by_layout.pop(choice.output, None)
        if layout is not None:
            seconds = {**choice.seconds, **layout.seconds}
            kernel = layout.kernel if layout.kernel in LAYOUT_KERNELS else choice.kernel
            cached = choice.cached and layout.cached
            choice = KernelChoice(choice.op, choice.output, kernel, seconds, cached)
        merged.append(choice)
    return merged + list(by_layout.values())
