"""PockEngine: sparse and efficient fine-tuning, compiled ahead of time.

import pockengine as pe
step = pe.compile(model, loss_fn, example_batch, optimizer=pe.optim.SGD(lr=0.1))
loss = step(*batch)
"""

from __future__ import annotations

from pockengine import ops as _ops  # noqa: F401  (registers every op)
from pockengine import optim
from pockengine.finetune import FinetuneError, finetune
from pockengine.ir import CompileError, PockEngineError, SchemeError, UnsupportedOpError
from pockengine.runtime import BatchError, NonFiniteError, StateError, TrainStep, compile
from pockengine.sparse import schemes

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
    "optim",
    "schemes",
]
__version__ = "0.1.0"
