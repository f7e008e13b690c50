"""The C emitter: a training graph and its memory plan as one C11 source file.

``emit_step`` writes ``pe_step(A, in)``: ``A`` is the arena (``plan.arena_bytes``, every
node result at ``plan.offsets``, in-place reuse included, since the plan already gave a
reusing result its input's offset) and ``in[k]`` points at graph input ``k`` (params,
buffers and optimizer state in the caller's state block; a batch input at its planned
arena offset, where the caller copies the batch). The body is one C statement per node,
under the node's IR text as a comment, taken from the kernel tables in ``lower_ew``,
``lower_reduce``, ``lower_nn`` and ``lower_loss``, in functions of 64 nodes that
``pe_step`` calls in order. Metadata tables (``pe_inputs``, ``pe_outputs``,
``pe_arena_bytes``) let the stand-alone trainer's ``main.c`` bind the same function
without Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pockengine.backends.c.views import View, step_views
from pockengine.ir import DType, Graph, Node, PockEngineError, Role, Value, print_node
from pockengine.plan import MemoryPlan

__all__ = [
    "CTYPES",
    "CEmitError",
    "EmitContext",
    "Lowering",
    "attr_float",
    "attr_int",
    "c_literal",
    "emit_step",
    "kernel_suffix",
    "merge_axes",
    "strides",
]

CTYPES = {
    DType.F32: "float",
    DType.F64: "double",
    DType.I32: "int32_t",
    DType.I64: "int64_t",
    DType.BOOL: "uint8_t",
    DType.U8: "uint8_t",  # 8-bit optimizer state's codes
    DType.I8: "int8_t",  # int8 weight codes
    DType.F16: "uint16_t",  # f16 bits (GGUF scales): lower_quant.half_ok says who reads them
}
_DTYPE_CODES = {DType.F32: 0, DType.F64: 1, DType.I32: 2, DType.I64: 3, DType.BOOL: 4, DType.U8: 5}
_DTYPE_CODES.update({DType.I8: 6, DType.F16: 7})  # low-bit weights' codes and f16 scales
_ROLE_CODES = {Role.INPUT: 0, Role.PARAM: 1, Role.BUFFER: 2, Role.CONST: 3, Role.STATE: 4}


class CEmitError(PockEngineError):
    """A node the C emitter cannot write (a dtype or attribute its kernel does not take);
    the message names the node and its source."""


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def c_literal(value: float | int | bool, dtype: DType) -> str:
    """``value`` as an exact C literal of ``dtype`` (floats in hexadecimal)."""
    if dtype in (DType.F32, DType.F64):
        x = float(value)
        if math.isnan(x):
            return "NAN"
        if math.isinf(x):
            return "INFINITY" if x > 0 else "-INFINITY"
        return f"(({CTYPES[dtype]}){x.hex()})"
    if dtype is DType.BOOL:
        return "1" if value else "0"
    return f"INT64_C({int(value)})" if dtype is DType.I64 else f"{int(value)}"


def kernel_suffix(v: Value) -> str:
    """The suffix of the kernel-file function instantiated for ``v``'s dtype (``_f32`` or
    ``_f64``, without the underscore); a ``CEmitError`` for any other dtype."""
    if v.dtype not in (DType.F32, DType.F64):
        raise CEmitError(f"{v} is {v.dtype}; this kernel takes f32 or f64")
    return "f32" if v.dtype is DType.F32 else "f64"


def attr_int(node: Node, key: str, default: int | None = None) -> int:
    """Attribute ``key`` of ``node`` as an int (``default`` when absent or None)."""
    value = node.attrs.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int):
        raise CEmitError(f"{node.op}: attribute {key}={value!r} is not an int")
    return int(value)


def attr_float(node: Node, key: str) -> float:
    """Attribute ``key`` of ``node`` as a float."""
    value = node.attrs.get(key)
    if not isinstance(value, int | float):
        raise CEmitError(f"{node.op}: attribute {key}={value!r} is not a number")
    return float(value)


@dataclass
class EmitContext:
    """What one node's lowering may ask: C names of values, and static arrays it adds."""

    graph: Graph
    plan: MemoryPlan
    names: dict[str, str]  # value name -> C identifier of its pointer
    statics: list[str] = field(default_factory=list)
    # a conv node's first output name -> its kernel (conv_kernels.py); absent: the rule
    conv_kernels: Mapping[str, str] = field(default_factory=dict)
    # a conv node's first output name -> its slot in the trainer's table (conv_table.py)
    conv_slots: Mapping[str, int] = field(default_factory=dict)
    # a slot's kernels where fewer than every valid one (budget_fit.export_candidates)
    conv_candidates: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # a GEMM node's first output name -> its micro-kernel shape (shape_tune.py); absent: 0
    gemm_shapes: Mapping[str, int] = field(default_factory=dict)
    # a GEMM node's first output name -> its slot in the trainer's shape table (gemm_table.py)
    gemm_slots: Mapping[str, int] = field(default_factory=dict)
    # a result run as a view of another value's memory (views.py) -> how
    views: Mapping[str, View] = field(default_factory=dict)
    _read: set[str] | None = field(default=None, repr=False)  # names some node or the graph reads

    def ref(self, v: Value) -> str:
        return self.names[v.name]

    def ref_if_read(self, v: Value) -> str:
        """``ref(v)``, or ``NULL`` where no node reads ``v`` and the graph does not return
        it (a kernel given NULL for an output skips computing it)."""
        if self._read is None:
            self._read = set(self.graph.users()) | {u.name for u in self.graph.outputs}
        return self.ref(v) if v.name in self._read else "NULL"

    def transposed(self, v: Value) -> Value | None:
        """The input of the transpose ``v`` is a strided view of (``ref(v)`` points at its
        memory), or None where ``v`` has its own elements in row-major order."""
        view = self.views.get(v.name)
        if view is None or not view.transposed:
            return None
        return self.graph.nodes[view.node].inputs[0]

    def longs(self, label: str, values: tuple[int, ...] | list[int]) -> str:
        """A static const long array holding ``values``; returns its name."""
        name = f"k{len(self.statics)}_{label}"
        body = ", ".join(str(int(x)) for x in values) or "0"
        self.statics.append(f"static const long {name}[] = {{{body}}};")
        return name

    def loops(
        self,
        shape: tuple[int, ...],
        operands: list[tuple[str, tuple[int, ...]]],
        body: Callable[[list[str]], str],
    ) -> str:
        """Nested loops over ``shape``; operand k (a pointer and its element strides over
        ``shape``, 0 on broadcast axes) is indexed by the k-th string given to ``body``.
        Axes that every operand walks contiguously together are merged first."""
        dims, strs = merge_axes(shape, [s for _, s in operands])
        idx = [_index(strs, k) for k in range(len(operands))]
        refs = [f"{ptr}[{i}]" for (ptr, _), i in zip(operands, idx, strict=True)]
        text = body(refs) + ";"
        for axis in reversed(range(len(dims))):
            text = f"for (long i{axis} = 0; i{axis} < {dims[axis]}; i{axis}++) {text}"
        return text


def merge_axes(
    shape: tuple[int, ...], all_strides: list[tuple[int, ...]]
) -> tuple[list[int], list[list[int]]]:
    """The loop extents over ``shape`` with size-1 axes dropped and adjacent axes merged
    where every operand's strides allow, and each operand's strides over them."""
    dims: list[int] = []
    merged: list[list[int]] = [[] for _ in all_strides]
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        if dims and all(m[-1] == s[axis] * size for m, s in zip(merged, all_strides, strict=True)):
            dims[-1] *= size
            for m, s in zip(merged, all_strides, strict=True):
                m[-1] = s[axis]
            continue
        dims.append(size)
        for m, s in zip(merged, all_strides, strict=True):
            m.append(s[axis])
    return dims, merged


def _index(all_strides: list[list[int]], k: int) -> str:
    terms = [
        f"i{axis}" if s == 1 else f"i{axis} * {s}"
        for axis, s in enumerate(all_strides[k])
        if s != 0
    ]
    return " + ".join(terms) or "0"


Lowering = Callable[[EmitContext, Node], str]


def _identifier(name: str, taken: set[str]) -> str:
    base = "v_" + re.sub(r"\W", "_", name)
    ident, n = base, 1
    while ident in taken:
        ident, n = f"{base}_{n}", n + 1
    taken.add(ident)
    return ident


def _declarations(
    graph: Graph, plan: MemoryPlan, names: dict[str, str], views: Mapping[str, View]
) -> dict[str, str]:
    """Value name -> the declaration of its pointer (an input's slot, or its arena offset;
    a view's: its root's)."""
    lines: dict[str, str] = {}
    where: dict[str, str] = {}
    taken: set[str] = set()
    for k, v in enumerate(graph.inputs):
        names[v.name] = _identifier(v.name, taken)
        where[v.name] = f"in[{k}]"
    for node in graph.nodes:
        for v in node.outputs:
            names[v.name] = _identifier(v.name, taken)
            view = views.get(v.name)
            if view is not None:
                where[v.name] = where[view.root]
            else:
                where[v.name] = f"(A + {plan.offsets.get(v.name, 0)})"
    for v in (*graph.inputs, *(v for node in graph.nodes for v in node.outputs)):
        ctype = CTYPES[v.dtype]
        lines[v.name] = f"{ctype} *const {names[v.name]} = ({ctype} *){where[v.name]};"
    return lines


def _metadata(graph: Graph, plan: MemoryPlan, file_names: Mapping[str, str]) -> list[str]:
    rows = []
    for v in graph.inputs:
        role = v.role or Role.INPUT
        shape = ", ".join(str(d) for d in v.shape) or "0"
        offset = plan.offsets.get(v.name, -1) if role is Role.INPUT else -1
        rows.append(
            f'    {{"{v.name}", "{file_names.get(v.name, v.name)}", {_DTYPE_CODES[v.dtype]}, '
            f"{_ROLE_CODES[role]}, {v.type.rank}, {{{shape}}}, {offset}}},"
        )
    index = {v.name: k for k, v in enumerate(graph.inputs)}
    outs = [
        f'    {{"{v.name}", {_DTYPE_CODES[v.dtype]}, {v.type.numel}, '
        f"{plan.offsets.get(v.name, -1)}, {index.get(v.name, -1)}}},"
        for v in graph.outputs
    ]
    return [
        f"const size_t pe_arena_bytes = {max(plan.arena_bytes, 64)};",
        f"const int pe_num_inputs = {len(graph.inputs)};",
        "const pe_input_info pe_inputs[] = {",
        *rows,
        "};",
        f"const int pe_num_outputs = {len(graph.outputs)};",
        "const pe_output_info pe_outputs[] = {",
        *outs,
        "};",
    ]


_PROFILE = """#include <time.h>
double pe_node_seconds[{n}];
static double pe_now(void) {{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}}"""


# Nodes per generated function: the compiler's time and memory grow faster than linearly
# with the size of one function (a MobileNetV2 step as one function: cc1 at 0.55 GiB).
_NODES_PER_FUNCTION = 64


def emit_step(
    graph: Graph,
    plan: MemoryPlan,
    kernels: Mapping[str, Lowering],
    file_names: Mapping[str, str] | None = None,
    profile: bool = False,
    conv_kernels: Mapping[str, str] | None = None,
    conv_slots: Mapping[str, int] | None = None,
    conv_candidates: Mapping[str, tuple[str, ...]] | None = None,
    gemm_shapes: Mapping[str, int] | None = None,
    gemm_slots: Mapping[str, int] | None = None,
) -> str:
    """The C source of ``graph``'s step: includes, metadata, static geometry, then the nodes
    in functions of ``_NODES_PER_FUNCTION`` that ``pe_step`` calls in order. With
    ``profile``, each node's statement is timed into ``pe_node_seconds[k]``;
    ``conv_kernels`` names the kernel of conv nodes (by first output; the rest: the rule);
    ``conv_slots`` makes those conv calls switch on the trainer's table (conv_table.py),
    over ``conv_candidates``' kernels where a node has an entry (else every valid one);
    ``gemm_shapes`` sets the GEMM's micro-kernel shape around a node's statement (by first
    output; the rest run the default shape), ``gemm_slots`` the shape the trainer's table
    chose (gemm_table.py)."""
    names: dict[str, str] = {}
    views = step_views(graph)
    decls = _declarations(graph, plan, names, views)
    ctx = EmitContext(
        graph,
        plan,
        names,
        conv_kernels=conv_kernels or {},
        conv_slots=conv_slots or {},
        conv_candidates=conv_candidates or {},
        gemm_shapes=gemm_shapes or {},
        gemm_slots=gemm_slots or {},
        views=views,
    )
    parts: list[str] = []
    for start in range(0, len(graph.nodes), _NODES_PER_FUNCTION):
        nodes = graph.nodes[start : start + _NODES_PER_FUNCTION]
        body = [_statement(ctx, kernels, node, start + i, profile) for i, node in enumerate(nodes)]
        used = dict.fromkeys(v.name for n in nodes for v in (*n.inputs, *n.outputs))
        parts += [
            f"static void pe_step_{start // _NODES_PER_FUNCTION}(unsigned char *restrict A, "
            "void *const *in) {",
            *(f"    {decls[name]}" for name in used),
            "    (void)A;",
            "    (void)in;",
            *body,
            "}",
            "",
        ]
    count = -(-len(graph.nodes) // _NODES_PER_FUNCTION)
    calls = [f"    pe_step_{k}(A, in);" for k in range(count)]
    header = [
        f"/* Generated by pockengine: graph {graph.name}, {len(graph.nodes)} nodes. */",
        f"/* {plan} */",
        '#include "pe_kernels.h"',
        '#include "elementwise.h"',
        "",
        *_metadata(graph, plan, file_names or {}),
        "",
        *ctx.statics,
        *(_PROFILE.format(n=len(graph.nodes)).splitlines() if profile else []),
        "",
    ]
    step = ["void pe_step(unsigned char *restrict A, void *const *in) {", *calls, "}", ""]
    return "\n".join([*header, *parts, *step])


def _statement(
    ctx: EmitContext, kernels: Mapping[str, Lowering], node: Node, k: int, profile: bool
) -> str:
    """Node ``k``'s C statement under its IR text (timed into slot ``k`` with ``profile``)."""
    text = print_node(node).replace("*/", "* /")
    if len(node.outputs) == 1 and node.outputs[0].name in ctx.views:
        return f"    /* {text} */\n    (void)0; /* a view: no statement */"
    try:
        statement = kernels[node.op](ctx, node)
    except (KeyError, TypeError, ValueError) as exc:
        raise CEmitError(f"C backend: cannot emit {text} ({exc})") from exc
    name = node.outputs[0].name if node.outputs else ""
    shape = f"pe_gemm_choice[{ctx.gemm_slots[name]}]" if name in ctx.gemm_slots else ""
    shape = shape or str(int(ctx.gemm_shapes.get(name, 0)) or "")
    if shape:
        statement = f"{{ pe_gemm_shape = {shape}; {statement} pe_gemm_shape = 0; }}"
    if profile:
        statement = f"{{ double t = pe_now(); {statement} pe_node_seconds[{k}] += pe_now() - t; }}"
    return f"    /* {text} */\n    {statement}"
