"""The C step's memory plan: ``plan_memory`` with reshapes in place.

A reshape (or ``stop_gradient``) copies its input's bytes unchanged, so when its input is
a node result read for the last time there, the result takes the input's buffer and the
copy is dropped (``lower_ew._copy`` emits nothing when the two offsets are equal); the
plan then counts one buffer, not two. The in-place results of ``reusable_inputs`` stay as
they are: it already treats a reshape as sharing its input's buffer.
"""

from __future__ import annotations

from pockengine.ir import Graph
from pockengine.plan import MemoryPlan, plan_memory
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import last_reads

__all__ = ["COPIES", "plan_step_memory"]

COPIES = frozenset({"reshape", "stop_gradient"})


def plan_step_memory(graph: Graph) -> MemoryPlan:
    """The arena plan of ``graph``'s C step."""
    reuse = dict(reusable_inputs(graph))
    produced = {v.name for node in graph.nodes for v in node.outputs}
    last = last_reads(graph)
    for i, node in enumerate(graph.nodes):
        if node.op not in COPIES or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        src, out = node.inputs[0], node.outputs[0]
        if src.name in produced and last.get(src.name) == i and src.type.nbytes == out.type.nbytes:
            reuse[i] = 0
    return plan_memory(graph, reuse)
