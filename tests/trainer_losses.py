"""An exported trainer's losses on given batches: the batches written as stacked ``.npy``
files, ``./train`` built (``cached_cc.make_trainer``) and run once over them."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.cached_cc import make_trainer

__all__ = ["trainer_losses"]


def trainer_losses(folder: Path, batches: Sequence[tuple[Any, ...]]) -> list[float]:
    """The ``step K loss L`` values of ``./train`` in ``folder`` over ``batches`` (each a
    tuple of torch tensors in the step's batch order), built and run here."""
    names = []
    for k in range(len(batches[0])):
        names.append(f"batch{k}.npy")
        np.save(folder / names[-1], np.stack([b[k].numpy() for b in batches]))
    make_trainer(folder)
    run = subprocess.run(["./train", *names], cwd=folder, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return [float(x.split()[-1]) for x in run.stdout.splitlines() if x.startswith("step ")]
