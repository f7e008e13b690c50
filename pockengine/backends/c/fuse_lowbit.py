"""C-backend rewrite: products with a low-bit frozen matrix read its codes in the GEMM.

``matmul(x, transpose(dequantize(q...), perm=(1, 0)))`` (a linear layer's forward, ``X
W^T``) and ``matmul(x, dequantize(q...))`` (its input gradient, ``dY W``), with ``W`` a
matrix, become ``dequantize_matmul(x, q..., transpose=...)`` (``ops/quant_matmul.py``),
whose kernel (``kernels/lowbit_gemm.c``) dequantises each panel as the GEMM packs it. The
fused loss head on a dequantized ``[vocab, k]`` table (a tied, quantized LM head; no bias,
no weight gradient) becomes ``dequantize_<op>`` (``ops/quant_loss.py``), whose tiles of
logits read the codes the same way (``kernels/loss.c``). The float matrix and its
transpose are then read by nothing and go, so the memory plan holds no whole-matrix
``dequantize`` buffer for these uses (an embedding's ``dequantize`` of its gathered rows
stays: it is already the rows only).

Needs: a verified training graph. Guarantees: the same values bit for bit on the C
backend (the packed values equal ``dequantize``'s; the GEMM sums in the same order); each
replaced node keeps its outputs (names and types); a ``dequantize`` or ``transpose`` that
something else still reads stays.
"""

from __future__ import annotations

from pockengine.ir import Attrs, CompileError, Graph, Node, Value, get_op
from pockengine.ops.quant_loss import LOWBIT_LOSS
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["fuse_lowbit_products"]


def _quantized_operand(y: Value, producers: dict[str, Node]) -> tuple[Node, bool] | None:
    """The ``dequantize`` node making matrix ``y`` (or the matrix ``y`` transposes), and
    whether ``y`` is its transpose."""
    node = producers.get(y.name)
    if node is None or y.type.rank != 2:
        return None
    transpose = node.op == "transpose" and node.attrs.get("perm") == (1, 0)
    if transpose:
        node = producers.get(node.inputs[0].name)
    if node is None or node.op != "dequantize":
        return None
    return node, transpose


def _product(node: Node, producers: dict[str, Node]) -> Node | None:
    x, y = node.inputs
    found = _quantized_operand(y, producers)
    if found is None or x.type.rank < 2 or x.dtype is not y.dtype:
        return None
    dq, transpose = found
    attrs = Attrs(scheme=dq.attrs["scheme"], group=dq.attrs["group"], transpose=transpose)
    return node.replace(op="dequantize_matmul", inputs=(x, *dq.inputs), attrs=attrs)


def _loss_head(node: Node, producers: dict[str, Node]) -> Node | None:
    fixed, at = LOWBIT_LOSS[node.op]
    frozen = not node.attrs.get("w_grad") and not node.attrs.get("b_grad")
    if len(node.inputs) != fixed or not node.attrs.get("vocab_major") or not frozen:
        return None
    found = _quantized_operand(node.inputs[at], producers)
    if found is None or found[1]:
        return None
    codes, *quantized = found[0].inputs
    inputs = (*node.inputs[:at], codes, *node.inputs[at + 1 :], *quantized)
    attrs = Attrs(node.attrs, scheme=found[0].attrs["scheme"], group=found[0].attrs["group"])
    return node.replace(op=f"dequantize_{node.op}", inputs=inputs, attrs=attrs)


def fuse_lowbit_products(graph: Graph) -> Graph:
    """``graph`` with its products of a dequantized matrix fused (the module docstring);
    ``graph`` itself when it has none."""
    producers = graph.producers()
    nodes, changed = [], False
    for node in graph.nodes:
        fused = None
        if node.op == "matmul":
            fused = _product(node, producers)
        elif node.op in LOWBIT_LOSS:
            fused = _loss_head(node, producers)
        if fused is not None:
            types = get_op(fused.op).infer_types([v.type for v in fused.inputs], fused.attrs)
            if types != tuple(v.type for v in node.outputs):
                raise CompileError(f"fuse_lowbit: {fused.op} would change {node.outputs}")
            node, changed = fused, True
        nodes.append(node)
    return eliminate_dead_code(graph.replace(nodes=tuple(nodes))) if changed else graph
