"""Which reshapes and transposes the C step runs as views of their input, writing nothing.

A view's result is its input's memory read another way: the emitter points the result at
the input's buffer (or at the graph input it derives from) and emits no statement for the
node; ``plan_step`` places the result at its source's offset and keeps that buffer alive
until the last reader of either. Two kinds qualify:

- a ``reshape`` or ``stop_gradient`` (same bytes, any reader), even where its input is
  read again later;
- a ``transpose`` every reader of which takes the operand strided: swapping the last two
  axes for a matrix product (``linear``'s weight, either side of ``matmul``; the GEMM packs
  the transposed operand from the source's rows), or ``(0, 2, 1, 3)`` for an attention's
  q, k, v and output gradient (the kernel reads each head at a row stride of ``H * E``).

Never a view: a graph output (the caller reads it from its own planned buffer), or a
value whose source an effectful node (an optimizer update) writes while the view is still
to be read (a copy would hold the old values). In-place writes into a source that a view
still reads are already excluded by ``plan.inplace.reusable_inputs``, which treats views
as sharing their input's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pockengine.ir import Graph, Node, get_op
from pockengine.plan.liveness import last_reads

__all__ = ["HEAD_PERM", "View", "step_views", "write_positions"]

HEAD_PERM = (0, 2, 1, 3)  # [B, L, H, E] -> [B, H, L, E]: an attention's head split
_COPIES = frozenset({"reshape", "stop_gradient"})
# (op, input position) -> the transposes a reader at that position takes strided
_MATRIX = "matrix"  # the last two axes swapped
_STRIDED: dict[tuple[str, int], str] = {
    ("linear", 1): _MATRIX,
    ("matmul", 0): _MATRIX,
    ("matmul", 1): _MATRIX,
    **{("attention", k): "head" for k in range(3)},
    **{("attention_grad", k): "head" for k in range(4)},
}


@dataclass(frozen=True, slots=True)
class View:
    """A node result that reads its ``root`` (a graph input or a planned node result)."""

    root: str  # the value whose memory it reads
    node: int  # the index of the node that defines it
    transposed: bool  # a transpose (readers take it strided), or the same bytes


def _is_matrix_swap(perm: tuple[int, ...]) -> bool:
    n = len(perm)
    return n >= 2 and perm == (*range(n - 2), n - 1, n - 2)


def _takes_strided(reader: Node, position: int, perm: tuple[int, ...]) -> bool:
    kind = _STRIDED.get((reader.op, position))
    if kind == "head":
        return perm == HEAD_PERM
    if kind != _MATRIX or not _is_matrix_swap(perm):
        return False
    if reader.op == "matmul" and reader.inputs[1].type.rank == 2:
        return position == 1 or reader.inputs[0].type.rank == 2  # x's rows fold otherwise
    return True


def step_views(graph: Graph) -> dict[str, View]:
    """Value name -> ``View`` for every result the C step runs as a view."""
    readers: dict[str, list[tuple[Node, int]]] = {}
    for node in graph.nodes:
        for k, v in enumerate(node.inputs):
            readers.setdefault(v.name, []).append((node, k))
    outputs = {v.name for v in graph.outputs}
    last = last_reads(graph)
    written = write_positions(graph)
    views: dict[str, View] = {}
    for i, node in enumerate(graph.nodes):
        if len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        src, out = node.inputs[0], node.outputs[0]
        if out.name in outputs or (src.name in views and views[src.name].transposed):
            continue
        if node.op in _COPIES:
            transposed = False
            if src.type.nbytes != out.type.nbytes:
                continue
        elif node.op == "transpose":
            perm = tuple(node.attrs["perm"])  # type: ignore[arg-type]
            transposed = True
            if not all(_takes_strided(r, k, perm) for r, k in readers.get(out.name, [])):
                continue
        else:
            continue
        root = views[src.name].root if src.name in views else src.name
        end = last.get(out.name, i)
        if any(i < u <= end for u in written.get(root, ())):
            continue
        views[out.name] = View(root, i, transposed)
    return views


def write_positions(graph: Graph) -> dict[str, list[int]]:
    """Value name -> the indices of the effectful nodes that write it in place."""
    out: dict[str, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for k in get_op(node.op).mutates:
            out.setdefault(node.inputs[k].name, []).append(i)
    return out
