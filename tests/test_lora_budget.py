"""LoRA under a memory budget and from a saved step artifact: what the PEFT peer measures
(``benchmarks/lora_peer.py``'s ``lora-remat`` and ``lora-remat-artifact`` cases) trains
the same bits as the plain compiled LoRA step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import pockengine as pe
from pockengine import schemes
from pockengine.sparse.lora import merge_adapters
from pockengine.zoo import Workload, bert_classifier

_STEPS = 3
Array = np.ndarray[Any, Any]


def _bert() -> Workload:
    return bert_classifier(layers=1, hidden=32, heads=4, ffn=48, vocab=64, seq=8, classes=3)


def _compile(w: Workload, budget: int | None = None, backend: str = "numpy") -> pe.TrainStep:
    scheme = schemes.lora(4, 8) | schemes.head()
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme, backend=backend,
                      optimizer=pe.optim.AdamW(lr=1e-2), memory_budget=budget)  # fmt: skip


def _train(step: Any, w: Workload) -> tuple[list[float], dict[str, Array]]:
    losses = [step(*w.make_batch(i)) for i in range(_STEPS)]
    return losses, step.flat_state_dict()


def _assert_same_training(a: tuple[list[float], dict[str, Array]],
                          b: tuple[list[float], dict[str, Array]]) -> None:  # fmt: skip
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name, value in a[1].items():
        np.testing.assert_array_equal(b[1][name], value, err_msg=name)


def test_lora_under_a_budget_recomputes_and_trains_the_same_bits() -> None:
    w = _bert()
    plain = _compile(w)
    before = plain.report().ours.planned_peak_bytes
    fitted = _compile(w, before * 9 // 10)
    remat = fitted.report().recomputation
    assert remat is not None and remat.segments
    assert remat.peak_before == before
    assert remat.peak_after < before
    assert fitted.report().ours.saved_activation_bytes < plain.report().ours.saved_activation_bytes
    _assert_same_training(_train(plain, w), _train(fitted, w))


def test_a_loaded_lora_step_trains_as_the_compiled_one(tmp_path: Path) -> None:
    w = _bert()
    budget = _compile(w).report().ours.planned_peak_bytes * 9 // 10
    compiled = _compile(w, budget, "torch")
    compiled.save(tmp_path / "step")
    loaded = pe.load_step(tmp_path / "step", backend="torch")
    assert loaded.report().recomputation == compiled.report().recomputation
    assert loaded.resolution.adapters == compiled.resolution.adapters
    compiled_run, loaded_run = _train(compiled, w), _train(loaded, w)
    _assert_same_training(compiled_run, loaded_run)
    # what the peer evaluates: the adapters merged into the frozen weights, from either step
    merged = merge_adapters(loaded_run[1], loaded.resolution.adapters)
    for a in loaded.resolution.adapters:
        assert not np.array_equal(merged[a.weight], loaded_run[1][a.weight]), a.weight
