"""Graph -> Graph passes, each pure; ``pipeline`` runs them in order."""

from __future__ import annotations

from pockengine.passes.dce import eliminate_dead_code
from pockengine.passes.pipeline import DEFAULT_PIPELINE, PassResult, run_pipeline

__all__ = ["DEFAULT_PIPELINE", "PassResult", "eliminate_dead_code", "run_pipeline"]
