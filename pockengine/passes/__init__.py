"""Graph -> Graph passes, each pure; ``pipeline`` runs them in order."""

from __future__ import annotations

from pockengine.passes.cse import eliminate_common_subexpressions
from pockengine.passes.dce import eliminate_dead_code
from pockengine.passes.fold import fold_constants
from pockengine.passes.fuse import fold_channel_affine, fuse_linear_bias
from pockengine.passes.fuse_loss import fuse_linear_cross_entropy, fuse_loss_backward
from pockengine.passes.pipeline import (
    DEFAULT_PIPELINE,
    FORWARD_PIPELINE,
    Pass,
    PassResult,
    forward_passes,
    run_pipeline,
)
from pockengine.passes.remat import rematerialize
from pockengine.passes.reorder import reorder_updates

__all__ = [
    "DEFAULT_PIPELINE",
    "FORWARD_PIPELINE",
    "Pass",
    "PassResult",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_channel_affine",
    "fold_constants",
    "forward_passes",
    "fuse_linear_bias",
    "fuse_linear_cross_entropy",
    "fuse_loss_backward",
    "rematerialize",
    "reorder_updates",
    "run_pipeline",
]
