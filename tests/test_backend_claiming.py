"""Per-node backend claiming (``backends.mixed``, ``plan.placement``).

- a list of backends trains the zoo models exactly as the NumPy oracle does, over a few
  steps, whether the split is total (onnxruntime claims every node) or partial (a torch
  backend whose table lacks relu, add and their gradients hands them to the fallback);
- the report shows the split: nodes and ops per backend, boundary transfers and bytes;
- a node no backend in the list claims is one UnsupportedOpError naming every such op
  and its source;
- when the primary claims everything the step runs the primary's own executable;
- the placement of a hand-written graph: segments, transfers, cached frozen weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.mixed import MixedBackend, MixedExecutable
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch.backend import TorchBackend, TorchExecutable
from pockengine.ir import UnsupportedOpError, parse_graph
from pockengine.plan.placement import place

Array = np.ndarray[Any, Any]
_LACKS = frozenset({"relu", "relu_grad", "add"})


class TorchWithoutRelu(TorchBackend):
    """A torch backend whose table lacks relu, its gradient and add (the fallback runs them)."""

    name = "torch-norelu"

    def supported_ops(self) -> frozenset[str]:
        return super().supported_ops() - _LACKS


class NumpyWithoutRelu(NumpyBackend):
    name = "numpy-norelu"

    def supported_ops(self) -> frozenset[str]:
        return super().supported_ops() - {"relu", "relu_grad"}


def _train(
    make: Callable[[], zoo.Workload], backend: Any, steps: int = 3
) -> tuple[pe.TrainStep, list[float], dict[str, Array]]:
    w = make()
    batches = [w.make_batch(seed) for seed in range(steps)]
    optimizer = pe.optim.SGD(lr=0.05, momentum=0.9)
    step = pe.compile(copy.deepcopy(w.model), w.loss_fn, batches[0], optimizer, backend=backend)
    losses = [step(*b) for b in batches]
    return step, losses, step.flat_state_dict()


_SPLITS = {
    "onnxruntime+numpy": lambda: ["onnxruntime", "numpy"],
    "torch-norelu+numpy": lambda: [TorchWithoutRelu(), "numpy"],
    "torch-norelu+onnxruntime": lambda: [TorchWithoutRelu(), "onnxruntime"],
}


@pytest.mark.parametrize("split", sorted(_SPLITS))
@pytest.mark.parametrize("model", ["mlp", "small_cnn"])
def test_mixed_steps_match_the_numpy_oracle(model: str, split: str) -> None:
    make = getattr(zoo, model)
    _, want_losses, want = _train(make, "numpy")
    _, losses, got = _train(make, _SPLITS[split]())
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_fallback_runs_what_the_first_backend_lacks_and_the_report_shows_it() -> None:
    step, _, _ = _train(zoo.mlp, [TorchWithoutRelu(), "numpy"], steps=1)
    assert isinstance(step._exec, MixedExecutable)
    report = step.report()
    placement = report.placement
    assert placement is not None
    counts = placement.nodes_per_backend()
    on_numpy = {op for op, k in zip(placement.ops, placement.assignment, strict=True) if k}
    assert on_numpy == {op for op in placement.ops if op in _LACKS}
    assert counts["numpy"] == sum(op in _LACKS for op in placement.ops) > 0
    assert counts["torch-norelu"] + counts["numpy"] == len(step.graph.nodes)
    assert len(placement.segments) > 2
    # each numpy segment reads torch results, and torch reads numpy's: both ways cross
    directions = {(t.src, t.dst) for t in placement.per_step()}
    assert directions == {(0, 1), (1, 0)}
    assert placement.transfer_bytes == sum(t.value.type.nbytes for t in placement.per_step())
    text = str(report)
    assert "nodes per backend: torch-norelu" in text and "numpy: " in text and "relu x" in text
    shown = report.to_dict()["backends"]
    assert shown["nodes"] == counts and shown["transfer_bytes_per_step"] > 0


def test_ops_no_backend_claims_are_one_error_naming_each_with_its_source() -> None:
    w = zoo.mlp()
    batch = w.make_batch(0)
    backends = [TorchWithoutRelu(), NumpyWithoutRelu()]
    with pytest.raises(UnsupportedOpError) as caught:
        pe.compile(copy.deepcopy(w.model), w.loss_fn, batch, backend=backends)
    ops = {op for op, _ in caught.value.entries}
    assert ops == {"relu", "relu_grad"}
    assert all(source for _, source in caught.value.entries)
    message = str(caught.value)
    assert "torch-norelu, numpy-norelu" in message and "relu_grad  at grad " in message


def test_a_step_the_primary_claims_whole_runs_its_own_executable() -> None:
    assert isinstance(get_backend(["torch"]), TorchBackend)
    step, _, _ = _train(zoo.mlp, ["torch", "numpy"], steps=1)
    assert isinstance(step.backend, MixedBackend)
    assert type(step._exec) is TorchExecutable
    placement = step.report().placement
    assert placement is not None and len(placement.segments) == 1 and not placement.transfers


GRAPH = """
graph g(x: f32[4,8] input, w: f32[8,8] param, f: f32[8,8] param(frozen), lr: f32[] state) {
  %h: f32[4,8] = matmul(x, f)
  %a: f32[4,8] = relu(%h)
  %z: f32[4,8] = matmul(%a, w)
  %l: f32[] = sum(%z, axes=(0, 1), keepdims=False)
  %at: f32[8,4] = transpose(%a, perm=(1, 0))
  %g: f32[8,8] = matmul(%at, %z)
  ! sgd_update(w, %g, lr, weight_decay=0.0)
  return %l
}
"""


def test_placement_of_a_graph_counts_segments_and_transfers() -> None:
    g = parse_graph(GRAPH)
    p = place(g, [0, 1, 0, 0, 1, 1, 1], ["torch", "numpy"])
    assert [(s.backend, s.start, s.stop) for s in p.segments] == [(0, 0, 1), (1, 1, 2),
                                                                  (0, 2, 4), (1, 4, 7)]  # fmt: skip
    crossing = {(t.value.name, t.src, t.dst, t.segment, t.cached) for t in p.transfers}
    # h to numpy, a back to torch; w is owned by numpy (its writer) and read by torch every
    # step; the batch x and the frozen f stay on the primary; lr, read by numpy, is never
    # written but starts on the primary: converted once and cached
    assert crossing == {("h", 0, 1, 1, False), ("a", 1, 0, 2, False), ("w", 1, 0, 2, False),
                        ("z", 0, 1, 3, False), ("lr", 0, 1, 3, True)}  # fmt: skip
    assert p.transfer_bytes == 128 + 128 + 256 + 128
    assert p.nodes_per_backend() == {"torch": 3, "numpy": 4}
    assert "4 segments; 4 transfers a step" in p.summary()


def test_auto_trains_as_the_oracle_and_times_each_kernel_once() -> None:
    from pockengine.backends import auto

    _, want_losses, want = _train(zoo.mlp, "numpy")
    step, losses, got = _train(zoo.mlp, "auto")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert isinstance(step.backend, auto.AutoBackend)
    timed = len(auto._TIMINGS)
    assert timed > 0
    placement = step.report().placement
    assert placement is not None
    again = step.backend.assign(step.graph)  # every timing cached: the same choice
    assert len(auto._TIMINGS) == timed and again == placement.assignment


def test_auto_switches_only_where_the_gain_beats_the_boundary() -> None:
    from pockengine.backends.auto import _cheapest_path

    g = parse_graph(GRAPH)
    first = [0] * len(g.nodes)
    nan = float("nan")
    # backend 1 is faster at node 1 by 1 ms, at node 4 by 1 us, slower at nodes 2 and 3 by
    # 0.1 ms; the update is untimed (nan: it stays on the first claimer)
    times = [[1e-3, 1e-3], [2e-3, 1e-3], [1e-3, 1.1e-3], [1e-3, 1.1e-3], [1e-6, 0.0],
             [1e-3, 1e-3], [nan, nan]]  # fmt: skip
    path = _cheapest_path(g, times, first, switch_s=1e-4, per_byte=0.0)
    assert path == (0, 1, 0, 0, 0, 0, 0)
    assert _cheapest_path(g, times, first, switch_s=1e-2, per_byte=0.0) == (0,) * 7
