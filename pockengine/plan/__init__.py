"""Analyses of a graph, each a noun returning a side object: liveness, the memory plan
(a static arena), the cost model."""

from __future__ import annotations

from pockengine.plan.cost import PHASES, Cost, NodeCost, cost
from pockengine.plan.inplace import inplace_ops, reusable_inputs
from pockengine.plan.liveness import PERSISTENT_ROLES, Interval, Liveness, liveness
from pockengine.plan.memory import ALIGNMENT, MemoryPlan, plan_memory

__all__ = [
    "ALIGNMENT",
    "PERSISTENT_ROLES",
    "PHASES",
    "Cost",
    "Interval",
    "Liveness",
    "MemoryPlan",
    "NodeCost",
    "cost",
    "inplace_ops",
    "liveness",
    "plan_memory",
    "reusable_inputs",
]
