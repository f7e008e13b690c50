"""The exported trainer's GEMM shape table: which nodes ``./train --tune`` times under each
of the build's micro-kernel shapes, and which shape a run sets around each
(``trainer/pe_tune.c``, ``kernels/gemm_micro.h``).

A GEMM slot is a node whose work is the GEMM's and large enough to tell the shapes apart
(``shape_tune.gemm_work`` at least ``shape_tune.MIN_WORK``): a ``matmul`` or ``linear``
node, or a convolution with a GEMM kernel (``shape_tune.GEMM_CONV_KERNELS``) among the
kernels it may take. In the exported ``step.c`` its statement sets ``pe_gemm_shape`` to
``pe_gemm_choice[slot]`` (0, the default shape, without a table) and back to 0. The
generated table (appended to ``convs.c``) holds per slot the node's name, op, dtype, its
product ``{M, N, K, ta, tb}`` or convolution geometry, its conv slot (whose choice names
the kernel timed; -1 for none) and the kernel without a choice (the rule's, for the build:
``PE_FAST_GEMM``), and a fingerprint of them all. ``./train --tune`` times each slot under
every shape after choosing the conv kernels and writes ``gemm-shapes.txt``; a later run
reads it and checks every line (its slot, and its shape against this build's shapes for
the slot's dtype) before it sets a choice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pockengine.backends.c.conv_kernels import (
    CONV_OPS,
    KERNEL_NAMES,
    conv_geometry,
)
from pockengine.backends.c.conv_table import name_literal, rule_source, slot_kernels
from pockengine.backends.c.shape_tune import (
    GEMM_CONV_KERNELS,
    MIN_WORK,
    PRODUCT_OPS,
    gemm_work,
    product_of,
    transposed_values,
)
from pockengine.backends.c.tune_harness import DTYPES
from pockengine.ir import Graph, Node

__all__ = ["SHAPE_FILE", "gemm_slots", "gemm_table_source"]

SHAPE_FILE = "gemm-shapes.txt"  # what ./train --tune writes and ./train reads
_PRODUCT = len(CONV_OPS)  # a product's op number (the harness's PE_TUNE_GEMM)


def _slot_nodes(graph: Graph, limits: Mapping[str, tuple[str, ...]] | None) -> list[Node]:
    nodes = []
    for node in graph.nodes:
        if not node.outputs or node.outputs[0].dtype not in DTYPES:
            continue
        if node.op in CONV_OPS:
            try:
                g = conv_geometry(node)
            except ValueError:
                continue  # the lowering reports it
            if not set(slot_kernels(node, g, limits)) & set(GEMM_CONV_KERNELS):
                continue
        elif node.op not in PRODUCT_OPS:
            continue
        if gemm_work(node) >= MIN_WORK:
            nodes.append(node)
    return nodes


def gemm_slots(graph: Graph, limits: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, int]:
    """Each GEMM slot's number by its node's first output, in graph order (``limits``: the
    conv kernels of nodes that may not take every valid one, as ``conv_table.conv_slots``)."""
    return {node.outputs[0].name: k for k, node in enumerate(_slot_nodes(graph, limits))}


def gemm_table_source(
    graph: Graph,
    conv_slots: Mapping[str, int],
    limits: Mapping[str, tuple[str, ...]] | None = None,
) -> str:
    """The GEMM slots' table and its fingerprint, for ``convs.c`` (``conv_slots``: the conv
    table's slots, whose choices name the kernel a convolution's shapes are timed with)."""
    transposed = transposed_values(graph)
    rows, arrays, facts = [], [], []
    for k, node in enumerate(_slot_nodes(graph, limits)):
        out = node.outputs[0]
        dt = DTYPES.index(out.dtype)
        if node.op in CONV_OPS:
            g = conv_geometry(node)
            rule = rule_source(node, g, limits)
            op, longs, conv_slot = CONV_OPS.index(node.op), g.longs(), conv_slots.get(out.name, -1)
        else:
            op, longs, conv_slot, rule = _PRODUCT, list(product_of(node, transposed)), -1, "0"
        arrays.append(f"static const long pe_gemm_g{k}[] = {{{', '.join(map(str, longs))}}};")
        rows.append(f"    {{{name_literal(out.name)}, {op}, {dt}, pe_gemm_g{k}, {conv_slot}, "
                    f"{rule}}},")  # fmt: skip
        facts.append(f"{out.name} {op} {dt} {longs} {conv_slot} {rule}")
    count = len(rows)
    digest = hashlib.sha256("\n".join(["gemm", *KERNEL_NAMES, *facts]).encode()).hexdigest()[:16]
    return "\n".join([
        "/* The GEMM slots (gemm_table.py): ./train --tune times each under every shape. */",
        f"const int pe_num_gemm_slots = {count};",
        f'const char pe_gemm_fingerprint[] = "{digest}";',
        f"int pe_gemm_choice[{max(count, 1)}];",
        *arrays,
        f"const pe_gemm_node pe_gemm_nodes[{max(count, 1)}] = {{",
        *(rows or ['    {"", 0, 0, 0, -1, 0},']),
        "};",
        "",
    ])  # fmt: skip
