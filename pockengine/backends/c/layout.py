"""C-backend rewrite: each convolution's layout, NCHW or NHWC, and the conversions between.

A convolution node (``conv2d``, ``conv2d_input_grad``, ``conv2d_weight_grad``) chosen for
NHWC becomes its ``conv2d_nhwc*`` op (``ops/conv_nhwc.py``), reading its activations
(x, gy) through ``layout_convert`` NCHW -> NHWC and giving its activation result (y, gx)
back through NHWC -> NCHW under the result's own name, so every other node still reads
NCHW. Only the convolutions that have NHWC kernels in C take NHWC
(``lower_layout.nhwc_kernel``: depthwise with one filter a channel, and pointwise).

Conversions are made once per value: the layer's forward convolution and its weight
gradient read one NHWC copy of x, its input and weight gradients one of gy. A value that
is itself an NHWC result converted back (a convolution chain in NHWC) is read in NHWC
directly: the pair cancels, and the NCHW copy goes when nothing else reads it
(``cancel_inverse_conversions`` does the same on any graph). The memory plan runs on the
rewritten graph, so it counts each converted buffer for as long as it lives.

Which nodes take NHWC is the caller's choice (``layout_tune.choose_layouts``: measured
with ``CBackend(tune=True)``, else ``heuristic_layout``).

Needs: a verified training graph (after ``lowering.lower_for_c``). Guarantees: every
original result keeps its name and type; the graph computes the same values; conversions
read only activations, never a parameter, so no update is reordered.
"""

from __future__ import annotations

from collections.abc import Collection

from pockengine.backends.c.conv_kernels import CONV_OPS, ConvGeometry, conv_geometry
from pockengine.backends.c.lower_layout import nhwc_kernel
from pockengine.ir import Attrs, CompileError, DType, Graph, Node, TensorType, Value
from pockengine.passes.dce import eliminate_dead_code

__all__ = [
    "HEURISTIC_MAX_MAP",
    "NCHW",
    "NHWC",
    "apply_layouts",
    "cancel_inverse_conversions",
    "heuristic_layout",
    "heuristic_nhwc",
    "nhwc_candidate",
]

NCHW, NHWC = "NCHW", "NHWC"
HEURISTIC_MAX_MAP = 16  # output positions up to which heuristic_layout takes NHWC
_NHWC_OP = {op: op.replace("conv2d", "conv2d_nhwc", 1) for op in CONV_OPS}
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


def heuristic_layout(op: str, g: ConvGeometry) -> str:
    """The layout without a measurement (``tune=False``, exported trainers): NHWC for a
    depthwise convolution (any of the three ops) whose output map has at most
    ``HEURISTIC_MAX_MAP`` positions, else NCHW.

    Measured on MobileNetV2's shapes (one thread, AVX-512, conversions included): on 4x4
    output maps NHWC took 0.15-0.5x the time of the NCHW kernels (a vector across channels
    wastes nothing, where a plane of 16 positions fills one vector at most); on 8x8 maps
    0.5-1.7x, a toss-up; from 16x16 it lost (1.3x to more than 3x). Pointwise convolutions
    are GEMMs either way and mostly measured within 10%, not worth two conversions.
    """
    wins = g.depthwise and g.o == g.c and g.oh * g.ow <= HEURISTIC_MAX_MAP
    return NHWC if wins else NCHW


def heuristic_nhwc(graph: Graph) -> set[str]:
    """The conv nodes (first output names) ``heuristic_layout`` puts in NHWC."""
    chosen = set()
    for node in graph.nodes:
        g = nhwc_candidate(node)
        if g is not None and heuristic_layout(node.op, g) == NHWC:
            chosen.add(node.outputs[0].name)
    return chosen


def _nhwc(t: TensorType) -> TensorType:
    n, c, h, w = t.shape
    return TensorType((n, h, w, c), t.dtype)


class _Rewriter:
    """Builds the node list; remembers each value's NHWC copy."""

    def __init__(self, graph: Graph) -> None:
        self.nodes: list[Node] = []
        self.nhwc: dict[str, Value] = {}  # NCHW value name -> its NHWC copy
        self.taken = {v.name for v in graph.inputs} | {
            v.name for n in graph.nodes for v in n.outputs
        }

    def fresh(self, base: str, t: TensorType) -> Value:
        name, k = f"{base}.nhwc", 1
        while name in self.taken:
            name, k = f"{base}.nhwc{k}", k + 1
        self.taken.add(name)
        return Value(name, t)

    def to_nhwc(self, v: Value, at: Node) -> Value:
        if v.name not in self.nhwc:
            y = self.fresh(v.name, _nhwc(v.type))
            attrs = Attrs(src=NCHW, dst=NHWC, channels=v.shape[1])
            self.nodes.append(Node("layout_convert", (v,), (y,), attrs, at.source, at.phase))
            self.nhwc[v.name] = y
        return self.nhwc[v.name]

    def convert(self, node: Node) -> None:
        ins = list(node.inputs)
        for k in _ACTIVATIONS[node.op]:
            ins[k] = self.to_nhwc(ins[k], node)
        attrs = node.attrs
        if node.op == "conv2d_input_grad":
            attrs = Attrs(attrs, x_shape=_nhwc(node.outputs[0].type).shape)
        op = _NHWC_OP[node.op]
        if node.op == "conv2d_weight_grad":
            self.nodes.append(node.replace(op=op, inputs=tuple(ins), attrs=attrs))
            return
        out = node.outputs[0]
        y = self.fresh(out.name, _nhwc(out.type))
        self.nodes.append(node.replace(op=op, inputs=tuple(ins), outputs=(y,), attrs=attrs))
        back = Attrs(src=NHWC, dst=NCHW, channels=out.shape[1])
        self.nodes.append(Node("layout_convert", (y,), (out,), back, node.source, node.phase))
        self.nhwc[out.name] = y  # a later NHWC reader takes y itself: the pair cancels


def apply_layouts(graph: Graph, nhwc: Collection[str]) -> Graph:
    """``graph`` with the conv nodes whose first output is named in ``nhwc`` in NHWC (each
    must be an ``nhwc_candidate``), their conversions shared and cancelled (module
    docstring); ``graph`` itself when ``nhwc`` names none of its nodes."""
    chosen = [n for n in graph.nodes if n.op in CONV_OPS and n.outputs[0].name in nhwc]
    if not chosen:
        return graph
    bad = [n.outputs[0].name for n in chosen if nhwc_candidate(n) is None]
    if bad:
        raise CompileError(f"layout pass: no NHWC kernel in C for the convolutions {bad}")
    names = {n.outputs[0].name for n in chosen}
    rewriter = _Rewriter(graph)
    for node in graph.nodes:
        if node.op in CONV_OPS and node.outputs[0].name in names:
            rewriter.convert(node)
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
