"""Kernel working memory as planned values: a conv node that may run a kernel with working
memory (Winograd F(4x4, 3x3): ``conv_kernels.winograd4_work``) gets one more output, a
1-D tensor of that many elements which nothing reads, so the memory plan places it in the
arena for the node's own step and the kernel receives it (``lower_nn._conv_call``). No
kernel allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from pockengine.backends.c.conv_kernels import CONV_OPS, conv_geometry, winograd4_work
from pockengine.ir import Graph, Node, TensorType, Value

__all__ = ["WORK_KERNELS", "add_workspaces", "with_workspace", "workspace_of"]

WORK_KERNELS = ("winograd4",)  # the kernels that take working memory


def workspace_of(node: Node) -> Value | None:
    """A conv node's working memory (its output after the kernel's own), or None."""
    return node.outputs[1] if node.op in CONV_OPS and len(node.outputs) > 1 else None


def with_workspace(node: Node, taken: set[str]) -> Node:
    """``node`` (a conv node) with its working memory as its last output, named apart from
    ``taken`` (which gains the name)."""
    out = node.outputs[0]
    name, k = f"{out.name}.work", 1
    while name in taken:
        name, k = f"{out.name}.work{k}", k + 1
    taken.add(name)
    elems = winograd4_work(node.op, conv_geometry(node))
    return node.replace(outputs=(out, Value(name, TensorType((elems,), out.dtype))))


def add_workspaces(graph: Graph, kernels_of: Callable[[Node], Collection[str]]) -> Graph:
    """``graph`` with working memory on each conv node any of whose possible kernels
    (``kernels_of``: the chosen one, or every candidate where the exported trainer may
    switch) takes it; ``graph`` itself when none does."""
    taken = {v.name for v in graph.inputs} | {v.name for n in graph.nodes for v in n.outputs}
    nodes, changed = [], False
    for node in graph.nodes:
        if node.op in CONV_OPS and any(k in WORK_KERNELS for k in kernels_of(node)):
            node, changed = with_workspace(node, taken), True
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes)) if changed else graph
