"""The torch backend's heap trims near a step's planned peak (``backends.torch.heap``).

- the trim points are nodes near the planned live peak that free a large share of it; a
  graph whose live peak is small gets none;
- a step and an evaluator that trim compute bit for bit what they compute without trims
  (the real ``malloc_trim`` runs, once per point and run), and match the NumPy backend;
- the trims are opt-in (``trim_peak=True``); ``keep_heap`` and a non-CPU device turn them
  off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch import heap as torch_heap
from pockengine.backends.torch.backend import TorchBackend, TorchExecutable
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import liveness
from pockengine.tasks.metrics import classification_eval

Array = np.ndarray[Any, Any]


def _workload() -> zoo.Workload:
    return zoo.mlp(batch=64, features=128, hidden=256)


def _compile(backend: Any) -> pe.TrainStep:
    w = _workload()
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.AdamW(lr=1e-3),
                      pe.schemes.full(), backend=backend)  # fmt: skip


def _counted(executable: Any) -> list[int]:
    """Count the generated function's heap trims (the real ``malloc_trim`` still runs)."""
    calls: list[int] = []
    real: Callable[[int], int] = executable.function.__globals__["heap_trim"]
    executable.function.__globals__["heap_trim"] = lambda pad: calls.append(pad) or real(pad)
    return calls


@pytest.fixture(scope="module")
def steps() -> dict[str, pe.TrainStep]:
    """The same step trimming, not trimming and on NumPy, compiled with a threshold low
    enough for this small graph to trim (the default needs a 64 MiB live peak)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_TRIM_BYTES", 1024)
        return {"trim": _compile(TorchBackend(trim_peak=True)), "plain": _compile(TorchBackend()),
                "numpy": _compile("numpy")}  # fmt: skip


def test_trim_points_sit_near_the_planned_peak(steps: dict[str, pe.TrainStep]) -> None:
    graph = steps["numpy"].graph
    live = liveness(graph, reusable_inputs(graph)).live_bytes()
    peak = max(live)
    points = steps["trim"]._exec.trim_points
    assert points and len(points) < len(graph.nodes)
    for k in points:
        assert live[k] >= peak / 2 and live[k] - live[k + 1] >= peak / 16
    assert torch_heap.trim_points(graph, reusable_inputs(graph)) == ()  # default threshold


def test_trimmed_step_and_evaluator_are_bit_identical(steps: dict[str, pe.TrainStep]) -> None:
    trimmed, plain, reference = steps["trim"], steps["plain"], steps["numpy"]
    points = trimmed._exec.trim_points
    assert points and plain._exec.trim_points == ()
    lines = trimmed._exec.source.splitlines()
    for k in points:  # line first_line + k is node k
        assert "heap_trim(0)" in lines[trimmed._exec._first_line - 1 + k]
    calls = _counted(trimmed._exec)
    w = _workload()
    for i in range(3):
        loss = trimmed(*w.make_batch(i))
        assert loss == plain(*w.make_batch(i))
        assert loss == pytest.approx(reference(*w.make_batch(i)), rel=1e-5)
    assert calls == [0] * (3 * len(points))
    want = plain.state_dict()
    for name, value in trimmed.state_dict().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    # the evaluator, compiled on each trained step with the same low threshold
    x, y = w.make_batch(5)
    example = (x, y, torch.ones(len(y)))
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_TRIM_BYTES", 1024)
        evaluators = {k: s.evaluator(_workload().model, classification_eval, example)
                      for k, s in steps.items()}  # fmt: skip
    assert evaluators["trim"]._exec.trim_points
    eval_calls = _counted(evaluators["trim"]._exec)
    for name, evaluator in evaluators.items():
        results[name] = evaluator(*(t.numpy() for t in example))
    assert eval_calls == [0] * len(evaluators["trim"]._exec.trim_points)
    np.testing.assert_array_equal(results["trim"], results["plain"])
    np.testing.assert_allclose(results["trim"], results["numpy"], rtol=1e-5)


def test_small_graphs_get_no_trims(steps: dict[str, pe.TrainStep]) -> None:
    executable = TorchBackend(trim_peak=True).compile(steps["numpy"].graph)  # default threshold
    assert isinstance(executable, TorchExecutable)
    assert executable.trim_points == () and "heap_trim(" not in executable.source


def test_trims_are_opt_in_and_keep_heap_and_other_devices_do_not_trim() -> None:
    assert not TorchBackend().trim_peak and TorchBackend(trim_peak=True).trim_peak
    assert not TorchBackend(keep_heap=True, trim_peak=True).trim_peak
    assert not TorchBackend("meta", trim_peak=True).trim_peak
