"""C-backend rewrite: a depthwise convolution reads its batch-normed, clipped input from the
batch norm's input, both ways, and a pointwise one forward, so the normalised tensor is
never stored.

Forward: ``(z, mean, var) = batch_norm_hardtanh(x, bw, bb)`` whose ``z`` only a depthwise
``conv2d(z, w[, bias])`` reads becomes one ``conv2d_bn_hardtanh(x, bw, bb, w[, bias])``
(``ops/conv_bn_act.py``) at the batch norm's place, with the convolution's output and the
statistics as results: ``kernels/dw_bn.c`` takes each channel's statistics and convolves
its planes normalised in scratch while they are still in cache. Backward: a depthwise
``conv2d_weight_grad(z, gy)`` whose ``z = batch_norm_apply(x, bw, bb, mean, var)``
(clipped; rematerialisation's copy, as ``fuse_bn.py`` leaves it) nothing else reads
becomes ``conv2d_bn_hardtanh_weight_grad(x, bw, bb, mean, var, gy)`` at the weight
gradient's place. MobileNetV2's expansion layers write and read z (the largest tensors of
the step) three times less. A pointwise ``conv2d(z, w)`` (1x1, stride 1, no padding, one
group, no bias) over such a ``z`` becomes the same ``conv2d_bn_hardtanh`` forward, which
``kernels/dw_bn.c`` runs as the convolution's GEMM with ``x`` normalised and clipped while
the GEMM packs it: MobileNetV2's projections no longer read z from memory.

Only convolutions the C backend would run with the depthwise kernels in NCHW are fused:
one filter a channel, ``rule_kernel`` choosing ``depthwise`` (small maps take the blocked
kernels, which these ops do not have), ``heuristic_layout`` keeping NCHW, input planes of at
least ``DW_BN_MIN_PLANE`` positions (smaller ones stay in cache unfused) and one channel's
planes of every image within ``DW_BN_BYTES`` (the kernel's stack scratch). With
``tune=True`` the fused nodes are not measured; they run the depthwise kernels.

Needs: ``fuse_bn``'s rewrite (``batch_norm_hardtanh``, ``batch_norm_apply``). Guarantees:
the fused nodes keep the replaced nodes' result names and types; a fused node reads
nothing a node between the two it replaces writes; a value something else reads is kept.
"""

from __future__ import annotations

from pockengine.backends.c.conv_kernels import conv_geometry, rule_kernel
from pockengine.backends.c.layout import NCHW, heuristic_layout
from pockengine.ir import Attrs, CompileError, DType, Graph, Node, Value, get_op

__all__ = ["DW_BN_BYTES", "DW_BN_MIN_PLANE", "PW_BN_MIN_PLANE", "fuse_depthwise_batch_norm"]

DW_BN_BYTES = 256 * 1024  # PE_DW_BN_BYTES in kernels/pe_kernels.h
# Input planes of at least this many positions: measured (MobileNetV2's shapes, batch 8, one
# thread, AVX-512) the fused forward took 0.63-0.9x the unfused pair's time from 32 x 32 up
# and the weight gradient 0.83-0.95x; on 16 x 16 and 8 x 8 planes, which stay in cache
# anyway, the forward gained nothing and the weight gradient lost 5-30% (its copy of gy).
DW_BN_MIN_PLANE = 32 * 32
# A pointwise conv2d (one GEMM) normalises its operand as linalg.c packs it (dw_bn.c) on
# planes of at least this many positions: MobileNetV2's 32 x 32 and 64 x 64 maps, whose
# normalised tensors (up to 12 MiB at batch 8) are read back from memory, not from cache.
PW_BN_MIN_PLANE = 32 * 32
_GEOMETRY = ("stride", "padding", "dilation", "groups")


def _fusable(conv: Node) -> bool:
    """Whether the C backend runs ``conv`` (conv2d or its weight gradient) with the NCHW
    depthwise kernels, on planes that fit dw_bn.c's scratch, or ``conv`` is a pointwise
    conv2d without bias on planes of at least ``PW_BN_MIN_PLANE`` positions."""
    dtype = conv.outputs[0].dtype
    if dtype not in (DType.F32, DType.F64):
        return False
    try:
        g = conv_geometry(conv)
    except ValueError:
        return False
    if g.pointwise and conv.op == "conv2d":
        return len(conv.inputs) == 2 and g.h * g.w >= PW_BN_MIN_PLANE
    if not (g.depthwise and g.o == g.c) or heuristic_layout(conv.op, g) != NCHW:
        return False
    scratch = g.n * (g.h * g.w + g.oh * g.ow) * dtype.itemsize
    large = g.h * g.w >= DW_BN_MIN_PLANE
    return (
        large and rule_kernel(conv.op, g, dtype.itemsize) == "depthwise" and scratch <= DW_BN_BYTES
    )


def _written_between(graph: Graph, start: int, end: int, values: tuple[Value, ...]) -> bool:
    """Whether a node in ``graph.nodes[start:end]`` writes one of ``values`` in place."""
    names = {v.name for v in values}
    for node in graph.nodes[start:end]:
        if any(node.inputs[k].name in names for k in get_op(node.op).mutates):
            return True
    return False


def _checked(fused: Node, outputs: tuple[Value, ...]) -> Node:
    types = get_op(fused.op).infer_types([v.type for v in fused.inputs], fused.attrs)
    types = types if isinstance(types, tuple) else (types,)
    if types != tuple(v.type for v in outputs):
        raise CompileError(f"fuse_dw_bn: {fused.op} would change {outputs}")
    return fused


def _bn_attrs(bn: Node, conv: Node, *extra: str) -> Attrs:
    keys = ("eps", "min_val", "max_val")
    return Attrs({k: bn.attrs[k] for k in keys}, **{k: conv.attrs[k] for k in (*extra, *_GEOMETRY)})


def _pairs(graph: Graph, conv_op: str, bn_op: str) -> dict[int, int]:
    """conv node index -> the index of the batch norm (``bn_op``) making its input, for
    each fusable pair: the conv the only reader of z, nothing between them writing what
    the fused node reads."""
    producers, users = graph.producers(), graph.users()
    index = {id(n): k for k, n in enumerate(graph.nodes)}
    returned = {v.name for v in graph.outputs}
    pairs = {}
    for k, node in enumerate(graph.nodes):
        if node.op != conv_op or not _fusable(node):
            continue
        z = node.inputs[0]
        bn = producers.get(z.name)
        if bn is None or bn.op != bn_op or bn.outputs[0] != z or z.name in returned:
            continue
        if bn.attrs.get("min_val") is None or len(users.get(z.name, [])) != 1:
            continue
        start = index[id(bn)]
        made_before = (
            all(
                v.name not in producers or index[id(producers[v.name])] < start
                for v in node.inputs[1:]
            )
            or conv_op != "conv2d"
        )  # the forward moves up to the batch norm's place
        if made_before and not _written_between(graph, start, k, (*bn.inputs, *node.inputs[1:])):
            pairs[k] = start
    return pairs


def _fuse_forward(graph: Graph) -> Graph:
    pairs = _pairs(graph, "conv2d", "batch_norm_hardtanh")
    at_bn = {bn: conv for conv, bn in pairs.items()}
    nodes = []
    for k, node in enumerate(graph.nodes):
        if k in pairs:
            continue
        if k in at_bn:
            conv = graph.nodes[at_bn[k]]
            x, bw, bb = node.inputs
            outputs = (conv.outputs[0], *node.outputs[1:])
            fused = conv.replace(
                op="conv2d_bn_hardtanh", inputs=(x, bw, bb, *conv.inputs[1:]), outputs=outputs,
                attrs=_bn_attrs(node, conv),
            )  # fmt: skip
            node = _checked(fused, outputs)
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes)) if pairs else graph


def _fuse_weight_grad(graph: Graph) -> Graph:
    pairs = _pairs(graph, "conv2d_weight_grad", "batch_norm_apply")
    applies = set(pairs.values())
    nodes = []
    for k, node in enumerate(graph.nodes):
        if k in applies:
            continue
        if k in pairs:
            bn = graph.nodes[pairs[k]]
            fused = node.replace(
                op="conv2d_bn_hardtanh_weight_grad", inputs=(*bn.inputs, node.inputs[1]),
                attrs=_bn_attrs(bn, node, "w_shape"),
            )  # fmt: skip
            node = _checked(fused, node.outputs)
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes)) if pairs else graph


def fuse_depthwise_batch_norm(graph: Graph) -> Graph:
    """``graph`` with its batch norm -> hardtanh -> depthwise convolution chains read from
    the batch norm's input, forward and weight gradient (the module docstring); ``graph``
    itself when it has none."""
    return _fuse_weight_grad(_fuse_forward(graph))
