"""The pass pipeline: a literal list that reads like a table of contents.

With checks on (tests, or ``PE_DEBUG=1``) ``ir.verify`` runs after every pass,
and a failure names the pass. Every stage is kept for ``inspect`` to print.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pockengine.ir import Graph, GraphVerifyError, verify
from pockengine.passes.cse import eliminate_common_subexpressions
from pockengine.passes.dce import eliminate_dead_code
from pockengine.passes.fold import fold_constants
from pockengine.passes.fuse import fold_channel_affine, fuse_linear_bias
from pockengine.passes.fuse_loss import (
    FUSED_LOSS_OPS,
    fuse_linear_cross_entropy,
    fuse_loss_backward,
)
from pockengine.passes.remat import rematerialize
from pockengine.passes.reorder import reorder_updates

__all__ = [
    "DEFAULT_PIPELINE",
    "FORWARD_PIPELINE",
    "Pass",
    "PassResult",
    "forward_passes",
    "run_pipeline",
]

Pass = Callable[[Graph], Graph]

# Folding first turns constant chains into ``full`` nodes that CSE can then merge;
# dead-code elimination drops what both left unread; fusion works on what is left (a
# fused loss and its backward kernel become one op where the cotangents allow it);
# rematerialisation then trades saved activations for recomputation in the backward pass;
# reordering comes last, on the final set of nodes, since it is about order alone.
# On the forward graph, before autodiff: rewrites whose backward autodiff then derives.
FORWARD_PIPELINE: tuple[Pass, ...] = (fold_channel_affine, fuse_linear_cross_entropy)

# On the training graph (forward, backward, updates).
DEFAULT_PIPELINE: tuple[Pass, ...] = (
    fold_constants,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fuse_linear_bias,
    fuse_loss_backward,
    rematerialize,
    reorder_updates,
)


def forward_passes(supported: Collection[str]) -> tuple[Pass, ...]:
    """FORWARD_PIPELINE for a backend that runs the ops ``supported``: the fused loss only
    where it has the fused ops' kernels (the C backend has none; it runs the unfused loss)."""
    if set(supported) >= FUSED_LOSS_OPS:
        return FORWARD_PIPELINE
    return tuple(p for p in FORWARD_PIPELINE if p is not fuse_linear_cross_entropy)


@dataclass(frozen=True)
class PassResult:
    graph: Graph
    stages: tuple[tuple[str, Graph], ...]  # (pass name, graph after it)


def _checks_on() -> bool:
    return os.environ.get("PE_DEBUG", "") not in ("", "0")


def run_pipeline(
    graph: Graph, passes: Sequence[Pass] = DEFAULT_PIPELINE, check: bool | None = None
) -> PassResult:
    check = _checks_on() if check is None else check
    stages = [("input", graph)]
    for p in passes:
        graph = p(graph)
        if check:
            try:
                verify(graph)
            except GraphVerifyError as exc:
                raise GraphVerifyError(f"after pass {p.__name__}: {exc}") from exc
        stages.append((p.__name__, graph))
    return PassResult(graph, tuple(stages))
