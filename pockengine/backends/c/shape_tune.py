"""Per-node micro-kernel shapes of the GEMM, chosen by measurement (``CBackend(tune=True)``).

Each build's GEMM has three register-block shapes for each dtype (``kernels/gemm_micro.h``:
12x32, 24x16 and 6x64 floats with AVX-512; 6x16, 12x8 and 4x24 with AVX2; the first is the
default). A shape that pads less fits a narrow or short product better, and the packed
panels' sizes move with it. Every shape computes the same bits (each element sums its
products in k order), so the choice changes time only.

For each node whose work is the GEMM's -- ``matmul``, ``linear``, and convolutions whose
kernel (measured or the rule's) is ``pointwise`` or ``im2col``, of at least ``MIN_WORK``
multiply-adds (below it a step cannot tell the shapes apart) -- every shape is timed by
the timing harness (``tune_harness``) on the node's exact product (a convolution: its
kernel on its geometry), in turn on one set of operands, and a shape other than the
default is kept where it takes at most ``_MARGIN`` of the default's time. The step sets
``pe_gemm_shape`` around that node's statement (``emit.py``). Attention and the fused
loss run the default shape.

The choices are kept in ``gemm-shapes.json`` under the C cache dir, keyed like
``conv-kernels.json`` (``tune.py``): op, dtype, product or geometry, kernel, threads,
target and toolchain; a second compile of the same model measures nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pockengine.backends.c import tune_harness
from pockengine.backends.c.conv_kernels import CONV_OPS, KERNEL_NAMES, conv_geometry, node_kernel
from pockengine.backends.c.driver import cache_dir, has_fast_gemm, toolchain
from pockengine.backends.c.tune import read_table, table_key, target_key, write_table
from pockengine.backends.c.views import step_views
from pockengine.ir import Graph, Node
from pockengine.plan.report import KernelChoice

__all__ = ["CACHE_NAME", "GEMM_CONV_KERNELS", "MIN_WORK", "PRODUCT_OPS", "GemmShape",
           "choose_shapes", "gemm_work", "product_of", "transposed_values",
           "with_shapes"]  # fmt: skip

CACHE_NAME = "gemm-shapes.json"
GEMM_CONV_KERNELS = ("pointwise", "im2col")  # the conv kernels whose work is the GEMM's
PRODUCT_OPS = ("matmul", "linear")  # the product ops, beside the GEMM convolutions
_MARGIN = 0.97  # a shape other than the default is kept at most this share of its time
_BUDGET_S = 0.02  # a shape's timed runs: about this long, 3 to 9 of them
_GIVE_UP = math.inf  # three candidates: every one is timed in full
MIN_WORK = 1 << 17  # multiply-adds below which a node keeps the default unmeasured (~2 us)


@dataclass(frozen=True)
class GemmShape:
    """A node's micro-kernel shape: its index in the build's list (``pe_gemm_shape``), its
    label, each shape's median seconds, the conv kernel it was timed with ("" for a
    product) and whether it came from the table."""

    op: str
    output: str
    index: int
    label: str
    seconds: dict[str, float]
    kernel: str
    cached: bool
    default: str  # the build's default shape's label


def transposed_values(graph: Graph) -> set[str]:
    """The values the step reads as transposed views of their source (``views.py``)."""
    return {name for name, view in step_views(graph).items() if view.transposed}


def product_of(node: Node, transposed: set[str]) -> tuple[int, int, int, int, int]:
    """(M, N, K, ta, tb) of one GEMM call of a ``matmul`` or ``linear`` node, as its lowering
    (``lower_nn.py``) makes it: ``linear`` reads x in rows (ta 0), the weight as a view."""
    x, w = node.inputs[:2]
    tb = int(w.name in transposed)
    if node.op == "linear":
        return math.prod(x.shape[:-1]), w.shape[1], w.shape[0], 0, tb
    ta = int(x.name in transposed)
    m, k, n = x.shape[-2], x.shape[-1], w.shape[-1]
    if w.type.rank == 2:
        m = math.prod(x.shape[:-1])
    return m, n, k, ta, tb


def gemm_work(node: Node) -> int:
    """The multiply-adds of one GEMM call of a product node, or of a convolution."""
    if node.op in CONV_OPS:
        g = conv_geometry(node)
        return g.n * g.o * g.oh * g.ow * (g.c // g.groups) * g.kh * g.kw
    m, n, k, _, _ = product_of(node, set())
    return m * n * k


def _entry(labels: tuple[str, ...], seconds: list[float]) -> dict[str, Any]:
    """The table entry of one node's timings: the kept shape and every finite median."""
    timed = {label: t for label, t in zip(labels, seconds, strict=True) if math.isfinite(t)}
    if labels[0] not in timed:  # the default could not be timed: keep it, unmeasured
        return {"kernel": labels[0], "seconds": {labels[0]: 0.0}}
    best = min(timed, key=lambda k: timed[k])
    keep = best if timed[best] <= _MARGIN * timed[labels[0]] else labels[0]
    return {"kernel": keep, "seconds": timed}


def choose_shapes(
    graph: Graph,
    kernels: Mapping[str, str],
    portable: bool | None = None,
    threads: int | None = None,
) -> list[GemmShape]:
    """The measured (or cached) micro-kernel shape of each GEMM node of ``graph``: products,
    and convolutions whose kernel (``kernels`` by first output, else the rule's) is one of
    ``GEMM_CONV_KERNELS``. The table under the cache dir gains what was measured."""
    path = cache_dir() / CACHE_NAME
    fast = has_fast_gemm(portable)
    tc_key = toolchain(portable).key
    transposed = transposed_values(graph)
    labels_of = {d: tune_harness.gemm_shapes(d, portable) for d in tune_harness.DTYPES}
    names = tuple(sorted({label for labels in labels_of.values() for label in labels}))
    table, dirty = read_table(path, names=names)
    fresh: dict[str, dict[str, Any]] = {}
    chosen = []
    for node in graph.nodes:
        out = node.outputs[0] if node.outputs else None
        if out is None or out.dtype not in tune_harness.DTYPES:
            continue
        labels = labels_of[out.dtype]
        if node.op not in (*PRODUCT_OPS, *CONV_OPS) or gemm_work(node) < MIN_WORK:
            continue
        if node.op in PRODUCT_OPS:
            kernel, product = "", product_of(node, transposed)
            flags = tc_key.replace("\n", " ")
            text = ",".join(map(str, product))
            key = f"gemm {out.dtype} p={text} threads={threads or 0} s={','.join(labels)} "
            key += f"| {target_key()} | {flags}"
        else:
            g = conv_geometry(node)
            kernel = node_kernel(node, g, kernels, fast_gemm=fast)
            if kernel not in GEMM_CONV_KERNELS:
                continue
            timed = (f"shape:{kernel}", *labels)
            key = table_key(node.op, out.dtype, g, tc_key, threads, timed)
        cached = key not in fresh and key in table and table[key]["kernel"] in labels
        if cached:
            entry = table[key]
        else:
            if key not in fresh:
                shapes = tuple(range(len(labels)))
                if kernel:
                    codes = (KERNEL_NAMES.index(kernel),) * len(labels)
                    seconds = tune_harness.harness_times(
                        node.op, [kernel] * len(labels), out.dtype, g, _BUDGET_S, _GIVE_UP,
                        portable, threads, codes=codes, shapes=shapes,
                    )  # fmt: skip
                else:
                    seconds = tune_harness.gemm_times(out.dtype, product, shapes, _BUDGET_S,
                                                      _GIVE_UP, portable, threads)  # fmt: skip
                fresh[key] = _entry(labels, seconds)
            entry = fresh[key]
        label = entry["kernel"]
        chosen.append(GemmShape(node.op, out.name, labels.index(label), label,
                                dict(entry["seconds"]), kernel, cached, labels[0]))  # fmt: skip
    if fresh or dirty:
        write_table(path, {**table, **fresh}, names=names)
    return chosen


def with_shapes(choices: list[KernelChoice], shapes: list[GemmShape]) -> list[KernelChoice]:
    """``choices`` with each GEMM node's shape: a conv node's choice gains its shape and
    the shapes' times; a product (or a conv node with one kernel) is added as kernel
    ``gemm`` (or its kernel) timed at the default shape."""
    by_output = {c.output: c for c in choices}
    merged = list(choices)
    for s in shapes:
        default = s.seconds.get(s.default, float("nan"))
        ordered = dict(sorted(s.seconds.items(), key=lambda item: item[1]))
        old = by_output.get(s.output)
        if old is not None:
            merged[merged.index(old)] = replace(old, shape=s.label, shape_seconds=ordered)
            continue
        kernel = s.kernel or "gemm"
        merged.append(KernelChoice(s.op, s.output, kernel, {kernel: default}, s.cached,
                                   s.label, ordered))  # fmt: skip
    return merged
