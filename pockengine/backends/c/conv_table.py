"""The exported trainer's convolution table: what ``./train --tune`` measures and what a
run reads back (``trainer/pe_tune.c``).

Each conv node with more than one valid kernel gets a slot. In the exported ``step.c``
its call is a ``switch`` on ``pe_conv_choice[slot]`` over its candidates, whose default
is the rule's kernel (``conv_kernels.rule_kernel``: what runs with no table). The
generated ``convs.c`` holds, per slot, the node's name, op, dtype, geometry, candidate set
and rule kernel (the build's: ``PE_FAST_GEMM``), a fingerprint of all of them (a table
measured for another step is refused), and the timing harness
(``tune_harness.harness_source``: the same one ``CBackend(tune=True)`` uses).
``./train --tune`` times every candidate of every slot on the device and writes
``conv-kernels.txt``; a later ``./train`` reads it, and checks every
line (its slot against the table's size, its kernel against that slot's candidates)
before it sets a choice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pockengine.backends.c.conv_kernels import (
    CONV_OPS,
    KERNEL_NAMES,
    ConvGeometry,
    candidates,
    conv_geometry,
    rule_kernel,
)
from pockengine.backends.c.layout_tune import layout_harness_source
from pockengine.backends.c.shape_tune import PRODUCT_OPS
from pockengine.backends.c.tune_harness import DTYPES, harness_source, shape_list_source
from pockengine.ir import Graph, Node

__all__ = ["TABLE_FILE", "conv_slots", "conv_table_source", "name_literal", "rule_source",
           "slot_kernels"]  # fmt: skip

TABLE_FILE = "conv-kernels.txt"  # what ./train --tune writes and ./train reads


Candidates = Mapping[str, tuple[str, ...]]  # by first output: the kernels a slot may take


def slot_kernels(node: Node, g: ConvGeometry, limits: Candidates | None) -> tuple[str, ...]:
    """The kernels conv node ``node`` may take: its entry in ``limits``, else every valid one."""
    return (limits or {}).get(node.outputs[0].name) or candidates(node.op, g)


def rule_source(node: Node, g: ConvGeometry, limits: Candidates | None) -> str:
    """The rule's kernel number of the node, as a C expression of the build the trainer is
    made with (``PE_FAST_GEMM``, kernels/pe_isa.h), among its ``slot_kernels``."""
    left_out = set(candidates(node.op, g)) - set(slot_kernels(node, g, limits))
    size = node.outputs[0].dtype.itemsize
    plain = KERNEL_NAMES.index(rule_kernel(node.op, g, size, left_out))
    fast = KERNEL_NAMES.index(rule_kernel(node.op, g, size, left_out, fast_gemm=True))
    return str(plain) if fast == plain else f"PE_FAST_GEMM ? {fast} : {plain}"


def _tunable(graph: Graph, limits: Candidates | None = None) -> list[Node]:
    nodes = []
    for node in graph.nodes:
        if node.op not in CONV_OPS or node.outputs[0].dtype not in DTYPES:
            continue
        try:
            g = conv_geometry(node)
        except ValueError:
            continue  # the lowering reports it
        if len(slot_kernels(node, g, limits)) > 1:
            nodes.append(node)
    return nodes


def conv_slots(graph: Graph, limits: Candidates | None = None) -> dict[str, int]:
    """Each tunable conv node's slot, by its first output's name, in graph order;
    ``limits``: the kernels of nodes that may not take every valid one (by a memory
    budget: ``budget_fit.export_candidates``)."""
    return {node.outputs[0].name: k for k, node in enumerate(_tunable(graph, limits))}


def name_literal(text: str) -> str:
    """A node's name as a C string literal for a table the trainer prints from: letters,
    digits and ``._-[]/`` and spaces kept, anything else (quotes, newlines) as ``_``."""
    safe = "".join(c if c.isalnum() or c in "._-[]/ " else "_" for c in text)
    return f'"{safe}"'


def conv_table_source(
    graph: Graph, limits: Candidates | None = None, layouts: str = "", nhwc_harness: bool = False
) -> str:
    """``convs.c``: the slots' table, its fingerprint, ``layouts`` (the layout candidates'
    table: ``layout_table.layout_table_source``) and the timing harness, with the ``nhwc``
    variant where ``nhwc_harness`` (``limits``: as ``conv_slots``)."""
    rows, arrays, facts = [], [], []
    for k, node in enumerate(_tunable(graph, limits)):
        g = conv_geometry(node)
        out = node.outputs[0]
        mask = sum(1 << KERNEL_NAMES.index(n) for n in slot_kernels(node, g, limits))
        rule = rule_source(node, g, limits)
        op, dt = CONV_OPS.index(node.op), DTYPES.index(out.dtype)
        arrays.append(f"static const long pe_conv_g{k}[] = {{{', '.join(map(str, g.longs()))}}};")
        rows.append(f"    {{{name_literal(out.name)}, {op}, {dt}, pe_conv_g{k}, {mask}, {rule}}},")
        facts.append(f"{out.name} {op} {dt} {g.longs()} {mask} {rule}")
    count = len(rows)
    digest = hashlib.sha256("\n".join([*KERNEL_NAMES, *facts]).encode()).hexdigest()[:16]
    kernels = ", ".join(f'"{n}"' for n in KERNEL_NAMES)
    head = [
        "/* Generated by pockengine: the trainer's tunable convolutions (conv_table.py). */",
        '#include "pe_isa.h"',
        '#include "pe_tune.h"',
        "",
        f"const int pe_num_convs = {count};",
        f"const int pe_num_conv_kernels = {len(KERNEL_NAMES)};",
        f"const char *const pe_conv_kernel_names[] = {{{kernels}}};",
        f'const char pe_conv_fingerprint[] = "{digest}";',
        f"int pe_conv_choice[{max(count, 1)}] = {{{', '.join(['-1'] * max(count, 1))}}};",
        *arrays,
        f"const pe_conv_node pe_conv_nodes[{max(count, 1)}] = {{",
        *(rows or ['    {"", 0, 0, 0, 0, 0},']),
        "};",
        "",
    ]
    # the timing harness and the shape list of the dtypes of the step's convolutions and
    # products only: the linker keeps the kernels a case names, and a float step needs no
    # double ones
    timed = [n for n in graph.nodes if n.op.startswith("conv2d") or n.op in PRODUCT_OPS]
    dtypes = tuple(d for d in DTYPES if any(n.outputs[0].dtype is d for n in timed if n.outputs))
    harness = layout_harness_source(dtypes) if nhwc_harness else harness_source(dtypes=dtypes)
    shape_list = shape_list_source(dtypes)
    return "\n".join([*head, shape_list, ""]) + layouts + harness.split("\n", 1)[1]
