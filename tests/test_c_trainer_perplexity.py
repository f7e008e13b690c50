"""After the same steps on the same batches, the stand-alone trainer's validation
perplexity is the torch backend's (within 1%).

A zoo LLaMA with int4 frozen weights and LoRA on q/v is exported to C and built; ``./train
--steps N --save trained.safetensors`` runs N steps over batches of a low-entropy token
chain, and the torch backend's step runs the same N steps in process. The trainer's saved
state (trained params by model name, optimizer state by IR name) is loaded into a second,
untrained step, and both steps are evaluated through the compiled evaluator the finetune
run uses (``causal_lm_eval``: exp of the mean next-token loss) on held-out batches no step
trained on. The two perplexities agree within 1%, and each moved from the untrained one by
more than that, so a save that was not loaded (or not trained) fails the check.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c.export import read_safetensors
from pockengine.frontend.import_memo import reused_imports
from pockengine.tasks.metrics import causal_lm_eval
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler"),
]
STEPS, HELD_OUT, VOCAB, BATCH, SEQ = 12, 4, 256, 2, 16
TOLERANCE = 0.01


def _chain(seed: int, count: int) -> Array:
    """``count`` batches ``[BATCH, SEQ]`` of a token chain: mostly a fixed successor of the
    previous token (so a few steps lower the loss on batches they never saw)."""
    successor = np.random.default_rng(0).permutation(VOCAB)
    rng = np.random.default_rng(seed)
    ids = np.empty((count, BATCH, SEQ), dtype=np.int64)
    ids[..., 0] = rng.integers(0, VOCAB, (count, BATCH))
    for t in range(1, SEQ):
        jump = rng.random((count, BATCH)) < 0.1
        ids[..., t] = np.where(jump, rng.integers(0, VOCAB, (count, BATCH)),
                               successor[ids[..., t - 1]])  # fmt: skip
    return ids


def _perplexity(step: Any, model: Any, held_out: Array) -> float:
    weights = np.ones(BATCH, dtype=np.float32)
    example = (torch.from_numpy(held_out[0]), torch.from_numpy(weights))
    evaluator = step.evaluator(model, causal_lm_eval, example)
    total = sum(float(np.asarray(evaluator(b, weights)).reshape(-1)[0]) for b in held_out)
    return math.exp(total / (len(held_out) * BATCH * (SEQ - 1)))


def test_trainer_validation_perplexity_matches_torch(tmp_path: Path) -> None:
    w = zoo.llama_lm(layers=1, tied=True, vocab=VOCAB, seq=SEQ, batch=BATCH)
    lora = pe.schemes.lora(rank=4, alpha=8, targets=["*q_proj", "*v_proj"])
    batches, held_out = _chain(1, STEPS), _chain(2, HELD_OUT)
    with reused_imports():  # one torch.export for both backends
        steps = {b: pe.compile(w.model, w.loss_fn, (torch.from_numpy(batches[0]),), backend=b,
                               optimizer=pe.optim.AdamW(lr=5e-2), scheme=lora,
                               frozen_dtype="int4")
                 for b in ("c", "torch")}  # fmt: skip
    folder = steps["c"].export(tmp_path / "trainer", target="c")
    np.save(folder / "ids.npy", batches)
    make_trainer(folder, "CFLAGS=-O1")
    run = subprocess.run(["./train", "--steps", str(STEPS), "--save", "trained.safetensors",
                          "ids.npy"], cwd=folder, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr

    loaded = steps["c"]  # untrained: it holds the values it was compiled with
    untrained = _perplexity(loaded, w.model, held_out)
    for b in batches:
        steps["torch"](b)
    torch_ppl = _perplexity(steps["torch"], w.model, held_out)

    saved = read_safetensors(folder / "trained.safetensors")
    names = set(loaded.state_names)
    params = {n: a for n, a in saved.items() if n in names}
    assert set(loaded.trained) <= set(params)
    result = loaded.load_state(params, strict=False)
    assert not (result.unexpected or result.mismatched), result.describe()
    optimizer = {n: a for n, a in saved.items() if n not in names}
    assert loaded.load_state(optimizer=optimizer).complete
    trainer_ppl = _perplexity(loaded, w.model, held_out)

    assert trainer_ppl == pytest.approx(torch_ppl, rel=TOLERANCE)
    for moved in (trainer_ppl, torch_ppl):
        assert abs(moved / untrained - 1) > TOLERANCE, (untrained, trainer_ppl, torch_ppl)
