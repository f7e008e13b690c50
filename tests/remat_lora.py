"""The LoRA step the recomputation tests compile: a small zoo LLaMA with LoRA on q/v and
int4 frozen weights, with or without a memory budget, on a given backend."""

from __future__ import annotations

import re

import pockengine as pe
from pockengine import zoo

STEPS = 3


def compile_lora(work: zoo.Workload, backend: str, budget: int | None) -> pe.TrainStep:
    """``work``'s LoRA (rank 4 on q/v) step with AdamW, int4 frozen weights, ``budget``."""
    scheme = pe.schemes.lora(rank=4, alpha=8, targets=["*q_proj", "*v_proj"])
    return pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(lr=1e-2),
                      scheme, backend=backend, memory_budget=budget,
                      frozen_dtype="int4")  # fmt: skip


def step_losses(step: pe.TrainStep, work: zoo.Workload) -> list[float]:
    """The losses of ``STEPS`` steps on ``work``'s batches 0, 1, ..."""
    return [float(step(*work.make_batch(k))) for k in range(STEPS)]


def layer_of(source: str) -> int | None:
    """The transformer layer a node's source names (``layers.K``), or None."""
    m = re.search(r"layers\.([0-9]+)", source)
    return int(m.group(1)) if m else None
