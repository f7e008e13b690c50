"""PockEngine: sparse and efficient fine-tuning, compiled ahead of time.

import pockengine as pe
step = pe.compile(model, loss_fn, example_batch, optimizer=pe.optim.SGD(lr=0.1))
loss = step(*batch)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pockengine import ops as _ops  # noqa: F401  (registers every op)
from pockengine import optim
from pockengine.ir import CompileError, PockEngineError, SchemeError, UnsupportedOpError
from pockengine.sparse import schemes
from pockengine.step.compiler import BatchError, NonFiniteError, StateError, TrainStep, compile

if TYPE_CHECKING:
    from pockengine.finetune import finetune
    from pockengine.finetune.run_folder.home_load import load_run
    from pockengine.step.artifact import load_step
    from pockengine.tasks.config import FinetuneError

__all__ = [
    "BatchError",
    "CompileError",
    "FinetuneError",
    "NonFiniteError",
    "PockEngineError",
    "SchemeError",
    "StateError",
    "TrainStep",
    "UnsupportedOpError",
    "compile",
    "finetune",
    "load_run",
    "load_step",
    "optim",
    "schemes",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The fine-tuning application on first use, so that ``import pockengine`` imports the
    engine alone: ``finetune`` (the ``pockengine.finetune`` package, which calls as
    ``finetune.finetune``), ``FinetuneError``, and ``load_run``, which needs torch, which
    the core never imports; ``load_step`` (``pockengine.step.artifact``) on first use too."""
    if name == "finetune":
        return importlib.import_module("pockengine.finetune")
    if name == "FinetuneError":
        from pockengine.tasks.config import FinetuneError

        return FinetuneError
    if name == "load_run":
        from pockengine.finetune.run_folder.home_load import load_run

        return load_run
    if name == "load_step":
        from pockengine.step.artifact import load_step

        return load_step
    raise AttributeError(f"module 'pockengine' has no attribute {name!r}")
