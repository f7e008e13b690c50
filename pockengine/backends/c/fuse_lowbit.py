"""C-backend rewrite: products with a low-bit frozen matrix read its codes in the GEMM.

``matmul(x, transpose(dequantize(q...), perm=(1, 0)))`` (a linear layer's forward, ``X
W^T``) and ``matmul(x, dequantize(q...))`` (its input gradient, ``dY W``), with ``W`` a
matrix, become ``dequantize_matmul(x, q..., transpose=...)`` (``ops/quant_matmul.py``),
whose kernel (``kernels/lowbit_gemm.c``) dequantises each panel as the GEMM packs it. The
float matrix and its transpose are then read by nothing and go, so the memory plan holds
no whole-matrix ``dequantize`` buffer for these uses.

Needs: a verified training graph. Guarantees: the same values bit for bit on the C
backend (the packed values equal ``dequantize``'s; the GEMM sums in the same order); a
``dequantize`` or ``transpose`` that something else still reads stays.
"""

from __future__ import annotations

from pockengine.ir import Graph, GraphBuilder, Node, Value
from pockengine.passes.fuse import NodeIndex, rewrite

__all__ = ["fuse_lowbit_products"]


def _quantized_operand(y: Value, index: NodeIndex) -> tuple[Node, bool] | None:
    """The ``dequantize`` node making matrix ``y`` (or the matrix ``y`` transposes), and
    whether ``y`` is its transpose."""
    node = index.producers.get(y.name)
    if node is None or y.type.rank != 2:
        return None
    transpose = node.op == "transpose" and node.attrs.get("perm") == (1, 0)
    if transpose:
        node = index.producers.get(node.inputs[0].name)
    if node is None or node.op != "dequantize":
        return None
    return node, transpose


def _rule(b: GraphBuilder, node: Node, index: NodeIndex, renamed: dict[str, Value]) -> Value | None:
    if node.op != "matmul" or node.inputs[0].type.rank < 2:
        return None
    x, y = node.inputs
    found = _quantized_operand(y, index)
    if found is None or x.dtype is not y.dtype:
        return None
    dq, transpose = found
    scheme, group = dq.attrs["scheme"], dq.attrs["group"]
    return b.call("dequantize_matmul", x, *dq.inputs, source=node.source, phase=node.phase,
                  scheme=scheme, group=group, transpose=transpose)  # fmt: skip


def fuse_lowbit_products(graph: Graph) -> Graph:
    """``graph`` with its products of a dequantized matrix fused (the module docstring);
    ``graph`` itself when it has none."""
    return rewrite(graph, _rule)
