"""C-backend rewrite: a transposed matrix product becomes the product of the transposed
operands, ``transpose(matmul(a, b)) = matmul(transpose(b), transpose(a))``.

Autodiff gives a weight ``W`` read as ``transpose(W)`` the gradient
``transpose(matmul(transpose(x), gy))``: the product makes ``W``'s gradient transposed and
a copy turns it round for the update. After this rewrite the product is
``matmul(transpose(gy), x)``, which the GEMM packs strided (``views.py``: a transpose a
matrix product reads is a view), so the weight gradient is written in its own layout and
nothing is copied. A transpose of an operand that is itself a transpose's result reads
that transpose's input (``transpose(transpose(x)) = x``), unless an update writes ``x``.

Only rank-2 products whose result nothing else reads (and the graph does not return)
qualify, with ``perm`` ``(1, 0)``. Needs: a verified graph. Guarantees: the rewritten
product keeps the transpose's result name and type, at the product's place (its operands
are defined there); nothing else moves; the numbers are the same up to the GEMM's
summation order, which is the same (each element sums over the shared axis in order).
"""

from __future__ import annotations

from pockengine.ir import Attrs, CompileError, Graph, Node, TensorType, Value, get_op
from pockengine.ir.rewrite import FreshNames
from pockengine.passes.dce import eliminate_dead_code

__all__ = ["transpose_products"]

_SWAP = (1, 0)


def _is_swap(node: Node | None) -> bool:
    return node is not None and node.op == "transpose" and tuple(node.attrs["perm"]) == _SWAP  # type: ignore[arg-type]


def _flipped(
    v: Value, producers: dict[str, Node], kept: set[str], names: FreshNames, at: Node
) -> tuple[Value, list[Node]]:
    """``v`` transposed: the input of the transpose that made ``v`` where that input stays
    as it is (in ``kept``: nothing writes it and this pass does not rename it), else a new
    transpose node (returned to go before the product)."""
    made = producers.get(v.name)
    if made is not None and _is_swap(made) and made.inputs[0].name in kept:
        return made.inputs[0], []
    out = Value(names.fresh(f"{v.name}_t"), TensorType((v.shape[1], v.shape[0]), v.type.dtype))
    node = Node("transpose", (v,), (out,), Attrs(perm=_SWAP), at.source, at.phase)
    return out, [node]


def transpose_products(graph: Graph) -> Graph:
    """Every ``transpose(matmul(a, b))`` of rank-2 operands whose product only the
    transpose reads, as ``matmul(transpose(b), transpose(a))`` at the product's place;
    repeated until none is left (a rewritten product may be a transpose's input in turn),
    so running it again changes nothing."""
    for _ in range(len(graph.nodes) + 1):  # each round moves transposes toward the inputs
        rewritten = _transpose_products_once(graph)
        if rewritten is graph:
            return graph
        graph = rewritten
    raise CompileError("fuse_transpose: the rewrite did not settle")


def _transpose_products_once(graph: Graph) -> Graph:
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers[v.name] = readers.get(v.name, 0) + 1
    producers = {v.name: n for n in graph.nodes for v in n.outputs}
    returned = {v.name for v in graph.outputs}
    written = {n.inputs[k].name for n in graph.nodes for k in get_op(n.op).mutates}
    turned: dict[str, Node] = {}  # product name -> the transpose that reads it
    for node in graph.nodes:
        src = node.inputs[0] if node.inputs else None
        product = producers.get(src.name) if src is not None else None
        if not _is_swap(node) or product is None or product.op != "matmul":
            continue
        if src is None or readers[src.name] != 1 or src.name in returned:
            continue
        if all(v.type.rank == 2 for v in product.inputs):
            turned[src.name] = node
    if not turned:
        return graph
    names, nodes = FreshNames(graph), []
    kept = {v.name for v in graph.inputs} | set(producers)
    kept -= written | set(turned)
    for node in graph.nodes:
        t = turned.get(node.outputs[0].name) if node.op == "matmul" else None
        if t is None:
            nodes.append(node)
            continue
        a, b = node.inputs
        bt, before_b = _flipped(b, producers, kept, names, node)
        at, before_a = _flipped(a, producers, kept, names, node)
        nodes += [*before_b, *before_a, node.replace(inputs=(bt, at), outputs=t.outputs)]
    moved = {id(t) for t in turned.values()}
    remaining = tuple(n for n in nodes if id(n) not in moved)
    return eliminate_dead_code(graph.replace(nodes=remaining))
