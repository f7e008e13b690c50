"""Analyses of a graph, each a noun returning a side object: liveness, the memory plan
(a static arena), the cost model."""

from __future__ import annotations

from pockengine.plan.cost import PHASES, Cost, NodeCost, cost
from pockengine.plan.inplace import INPLACE_OPS, reusable_inputs
from pockengine.plan.liveness import PERSISTENT_ROLES, Interval, Liveness, liveness
from pockengine.plan.memory import ALIGNMENT, MemoryPlan, plan_memory

__all__ = [
    "ALIGNMENT",
    "INPLACE_OPS",
    "PERSISTENT_ROLES",
    "PHASES",
    "Cost",
    "Interval",
    "Liveness",
    "MemoryPlan",
    "NodeCost",
    "cost",
    "liveness",
    "plan_memory",
    "reusable_inputs",
]
