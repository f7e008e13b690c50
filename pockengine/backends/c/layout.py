"""C-backend rewrite: each convolution's layout (NCHW, NHWC or NCHW{c}c) and the
conversions between.

A convolution node (``conv2d``, ``conv2d_input_grad``, ``conv2d_weight_grad``) chosen for
NHWC becomes its ``conv2d_nhwc*`` op (``ops/conv_nhwc.py``), one chosen for the channel-
blocked NCHW{c}c its ``conv2d_nchwc*`` op (``ops/conv_blocked.py``, attribute ``block``),
reading its activations (x, gy) through ``layout_convert`` from NCHW and giving its
activation result (y, gx) back through a conversion to NCHW under the result's own name,
so every other node still reads NCHW. Only the convolutions that have such kernels in C
take them (``lower_layout``: NHWC for depthwise ones with one filter a channel and
pointwise ones, NCHW{c}c for the depthwise ones, with c = ``BLOCK_BYTES`` / itemsize: one
cache line of channels, 16 floats or 8 doubles).

Conversions are made once per value and layout: the layer's forward convolution and its
weight gradient read one converted copy of x, its input and weight gradients one of gy. A
value that is itself a converted result converted back (a convolution chain in one layout)
is read in that layout directly: the pair cancels, and the NCHW copy goes when nothing
else reads it (``cancel_inverse_conversions`` does the same on any graph). The memory plan
runs on the rewritten graph, so it counts each converted buffer for as long as it lives.

Which nodes take which layout is the caller's choice (``layout_tune.choose_layouts``:
measured with ``CBackend(tune=True)``, else ``heuristic_layout``).

Needs: a verified training graph (after ``lowering.lower_for_c``). Guarantees: every
original result keeps its name and type; the graph computes the same values; conversions
read only activations, never a parameter, so no update is reordered.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pockengine.backends.c.conv_kernels import CONV_OPS, ConvGeometry, conv_geometry, rule_kernel
from pockengine.backends.c.lower_layout import blocked_kernel, nhwc_kernel
from pockengine.ir import Attrs, CompileError, DType, Graph, Node, TensorType, Value
from pockengine.ops.layout import block_of, shape_in
from pockengine.passes.dce import eliminate_dead_code

__all__ = [
    "BLOCK_BYTES",
    "HEURISTIC_MAX_MAP",
    "NCHW",
    "NHWC",
    "apply_layouts",
    "as_layouts",
    "blocked_layout",
    "cancel_inverse_conversions",
    "heuristic_layout",
    "heuristic_nhwc",
    "layout_candidates",
    "nhwc_candidate",
]

NCHW, NHWC = "NCHW", "NHWC"
HEURISTIC_MAX_MAP = 16  # output positions up to which heuristic_layout takes NHWC
BLOCK_BYTES = 64  # an NCHW{c}c block: one cache line of channels
_NHWC_OP = {op: op.replace("conv2d", "conv2d_nhwc", 1) for op in CONV_OPS}
_BLOCKED_OP = {op: op.replace("conv2d", "conv2d_nchwc", 1) for op in CONV_OPS}
_ACTIVATIONS = {"conv2d": (0,), "conv2d_input_grad": (0,), "conv2d_weight_grad": (0, 1)}


def nhwc_candidate(node: Node) -> ConvGeometry | None:
    """The geometry of a float conv node that has an NHWC kernel in C, else None."""
    if node.op not in CONV_OPS or node.outputs[0].dtype not in (DType.F32, DType.F64):
        return None
    try:
        g = conv_geometry(node)
    except ValueError:
        return None
    return g if nhwc_kernel(g) is not None else None


def blocked_layout(dtype: DType) -> str:
    """The channel-blocked layout of ``dtype`` maps: NCHW{c}c, c channels a cache line."""
    return f"NCHW{BLOCK_BYTES // dtype.itemsize}c"


def layout_candidates(node: Node) -> tuple[str, ...]:
    """The layouts other than NCHW that ``node`` (a float conv node) has kernels for in C:
    NHWC, then its dtype's ``blocked_layout``; empty for any other node."""
    g = nhwc_candidate(node)
    if g is None:
        return ()
    blocked = (blocked_layout(node.outputs[0].dtype),) if blocked_kernel(g) else ()
    return (NHWC, *blocked)


def heuristic_layout(op: str, g: ConvGeometry) -> str:
    """The layout without a measurement (``tune=False``, exported trainers): NHWC for a
    depthwise convolution (any of the three ops) whose output map has at most
    ``HEURISTIC_MAX_MAP`` positions, unless the rule's NCHW kernel is ``blocked`` (which
    reads NCHW through blocks of channels, the conversion folded in: on MobileNetV2's 4x4
    maps 0.66-0.85x the time of NHWC with its conversions), else NCHW.

    Measured on MobileNetV2's shapes (one thread, AVX-512, conversions included): on 4x4
    output maps NHWC took 0.15-0.5x the time of the NCHW kernels (a vector across channels
    wastes nothing, where a plane of 16 positions fills one vector at most); on 8x8 maps
    0.5-1.7x, a toss-up; from 16x16 it lost (1.3x to more than 3x). Pointwise convolutions
    are GEMMs either way and mostly measured within 10%, not worth two conversions.
    """
    wins = g.depthwise and g.o == g.c and g.oh * g.ow <= HEURISTIC_MAX_MAP
    # the rule of a wide-vector build: an export fixes the layout before the build is
    # known, and up to HEURISTIC_MAX_MAP positions both builds' rules agree
    return NHWC if wins and rule_kernel(op, g, 4, fast_gemm=True) != "blocked" else NCHW


def heuristic_nhwc(graph: Graph) -> set[str]:
    """The conv nodes (first output names) ``heuristic_layout`` puts in NHWC."""
    chosen = set()
    for node in graph.nodes:
        g = nhwc_candidate(node)
        if g is not None and heuristic_layout(node.op, g) == NHWC:
            chosen.add(node.outputs[0].name)
    return chosen


def _laid(t: TensorType, layout: str) -> TensorType:
    return TensorType(shape_in(layout, *t.shape), t.dtype)


class _Rewriter:
    """Builds the node list; remembers each value's copies in other layouts."""

    def __init__(self, graph: Graph) -> None:
        self.nodes: list[Node] = []
        self.copies: dict[tuple[str, str], Value] = {}  # (NCHW name, layout) -> its copy
        self.taken = {v.name for v in graph.inputs} | {
            v.name for n in graph.nodes for v in n.outputs
        }

    def fresh(self, base: str, t: TensorType, layout: str) -> Value:
        stem = f"{base}.{layout.lower()}"
        name, k = stem, 1
        while name in self.taken:
            name, k = f"{stem}{k}", k + 1
        self.taken.add(name)
        return Value(name, t)

    def laid_out(self, v: Value, layout: str, at: Node) -> Value:
        key = (v.name, layout)
        if key not in self.copies:
            y = self.fresh(v.name, _laid(v.type, layout), layout)
            attrs = Attrs(src=NCHW, dst=layout, channels=v.shape[1])
            self.nodes.append(Node("layout_convert", (v,), (y,), attrs, at.source, at.phase))
            self.copies[key] = y
        return self.copies[key]

    def convert(self, node: Node, layout: str) -> None:
        ins = list(node.inputs)
        for k in _ACTIVATIONS[node.op]:
            ins[k] = self.laid_out(ins[k], layout, node)
        attrs = node.attrs
        if layout == NHWC:
            op = _NHWC_OP[node.op]
            if node.op == "conv2d_input_grad":
                attrs = Attrs(attrs, x_shape=_laid(node.outputs[0].type, NHWC).shape)
        else:  # NCHW{c}c: x_shape stays the NCHW shape
            op = _BLOCKED_OP[node.op]
            attrs = Attrs(attrs, block=block_of(node.op, layout))
        if node.op == "conv2d_weight_grad":
            self.nodes.append(node.replace(op=op, inputs=tuple(ins), attrs=attrs))
            return
        out = node.outputs[0]
        y = self.fresh(out.name, _laid(out.type, layout), layout)
        self.nodes.append(node.replace(op=op, inputs=tuple(ins), outputs=(y,), attrs=attrs))
        back = Attrs(src=layout, dst=NCHW, channels=out.shape[1])
        self.nodes.append(Node("layout_convert", (y,), (out,), back, node.source, node.phase))
        # a later reader in this layout takes y itself: the pair cancels
        self.copies[(out.name, layout)] = y


def as_layouts(layouts: Collection[str] | Mapping[str, str]) -> dict[str, str]:
    """The conv nodes (first output names) that take a layout other than NCHW, with it:
    ``layouts`` a mapping to layouts, or a plain collection of names, each meaning NHWC."""
    chosen = layouts if isinstance(layouts, Mapping) else dict.fromkeys(layouts, NHWC)
    return {name: layout for name, layout in chosen.items() if layout != NCHW}


def apply_layouts(graph: Graph, layouts: Collection[str] | Mapping[str, str]) -> Graph:
    """``graph`` with its conv nodes in the layouts ``layouts`` gives by first output name
    (``as_layouts``; each layout among the node's ``layout_candidates``), their conversions
    shared and cancelled (module docstring); ``graph`` itself when ``layouts`` names none
    of its nodes."""
    chosen = as_layouts(layouts)
    nodes = [n for n in graph.nodes if n.op in CONV_OPS and n.outputs[0].name in chosen]
    if not nodes:
        return graph
    bad = [
        f"{n.outputs[0].name} ({chosen[n.outputs[0].name]})"
        for n in nodes
        if chosen[n.outputs[0].name] not in layout_candidates(n)
    ]
    if bad:
        raise CompileError(
            f"layout pass: no C kernel in the chosen layout for the convolutions {bad}"
        )
    rewriter = _Rewriter(graph)
    for node in graph.nodes:
        layout = chosen.get(node.outputs[0].name) if node.op in CONV_OPS else None
        if layout is not None:
            rewriter.convert(node, layout)
        else:
            rewriter.nodes.append(node)
    return eliminate_dead_code(graph.replace(nodes=tuple(rewriter.nodes)))


def _inverse(first: Node, second: Node) -> bool:
    a, b = first.attrs, second.attrs
    return (a["src"], a["dst"], a["channels"]) == (b["dst"], b["src"], b["channels"])


def cancel_inverse_conversions(graph: Graph) -> Graph:
    """Each ``layout_convert`` of a value that an inverse ``layout_convert`` made is
    replaced by that conversion's input (``a -> B -> A`` reads ``a``); conversions left
    unread go. Returned values are kept."""
    producers = graph.producers()
    returned = {v.name for v in graph.outputs}
    mapping: dict[str, Value] = {}
    for node in graph.nodes:
        if node.op != "layout_convert" or node.outputs[0].name in returned:
            continue
        made = producers.get(node.inputs[0].name)
        if made is not None and made.op == "layout_convert" and _inverse(made, node):
            source = made.inputs[0]
            mapping[node.outputs[0].name] = mapping.get(source.name, source)
    if not mapping:
        return graph
    nodes = [n.replace(inputs=tuple(mapping.get(v.name, v) for v in n.inputs)) for n in graph.nodes]
    return eliminate_dead_code(graph.replace(nodes=tuple(nodes)))
