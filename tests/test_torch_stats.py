"""Batch norm's running statistics and the gated writes of the torch backend
(``backends/torch/kernels_stats.py``, absorbed through ``links.Absorber``).

- the running statistics and batch counts after several steps match the NumPy backend and
  torch eager's own ``BatchNorm2d``;
- a step with a non-finite loss changes no state, a finite one writes it all;
- batch norm's variance is computed only where a node reads it;
- the absorbed nodes emit no code: no per-buffer copies or running-statistic arithmetic in
  the source, and far fewer ATen calls a step than without absorption.
"""

from __future__ import annotations

import collections
import copy
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch import kernels_stats
from pockengine.backends.torch.backend import TorchBackend
from pockengine.backends.torch.kernels_stats import gated_update_
from pockengine.ir import DType, GraphBuilder, Role, TensorType

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_STEPS = 3


def _buffers(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


def _mcu() -> zoo.Workload:
    return zoo.mobilenet_v2(width=0.35, batch=2, size=32, classes=10)


def _mobilenet_f64() -> zoo.Workload:
    # float32 MobileNetV2 at random weights is ill-conditioned (test_torch_backend's
    # ``_mobilenet``): float64, batch 4 at 64x64
    return zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64))


@pytest.mark.parametrize("scheme", ["full", "head"])
def test_running_statistics_match_numpy(scheme: str) -> None:
    """The buffers and losses of a few SGD steps, trained in full or the head alone (frozen
    batch norms still track their statistics)."""
    w = _mobilenet_f64()
    schemes = zoo.benchmark_schemes("mbv2")
    steps = [
        pe.compile(
            w.model,
            w.loss_fn,
            w.make_batch(0),
            pe.optim.SGD(lr=0.01, momentum=0.9),
            schemes[scheme],
            backend=backend,
        )
        for backend in ("numpy", "torch")
    ]
    for i in range(_STEPS):
        losses = [step(*w.make_batch(i)) for step in steps]
        assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-5)
    want, got = (_buffers(step.state_dict()) for step in steps)
    assert want and set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    assert all(int(v) == _STEPS for k, v in got.items() if "num_batches" in k)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, momentum=0.25)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))  # type: ignore[no-any-return]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def test_running_statistics_match_torch_eager() -> None:
    """Another momentum (0.25), a zero learning rate (so only the batches move the
    statistics): the same buffers as eager ``BatchNorm2d`` in train mode."""
    model = _ConvBN()
    eager = copy.deepcopy(model).train()
    rng = np.random.default_rng(0)
    batches = [
        (
            torch.from_numpy(rng.standard_normal((4, 3, 6, 6)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 4, 4)),
        )
        for _ in range(_STEPS)
    ]
    step = pe.compile(model, _loss, batches[0], pe.optim.SGD(lr=0.0), backend="torch")
    for x, y in batches:
        step(x, y)
        with torch.no_grad():
            eager(x)
    got = step.state_dict()
    for name, value in eager.state_dict().items():
        if name.startswith("bn."):
            np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    assert "aten_native_batch_norm(" in step._exec.source
    assert re.search(r"aten_native_batch_norm\([^)]*, True, 0\.25, ", step._exec.source)


def test_a_non_finite_step_changes_nothing_and_a_finite_one_writes_all() -> None:
    w = _mcu()
    step = pe.compile(
        w.model, w.loss_fn, w.make_batch(0), pe.optim.SGD(lr=0.01, momentum=0.9), backend="torch"
    )
    step.on_nonfinite = "skip"
    step(*w.make_batch(0))
    before = {**step.state_dict(), **step.optimizer_state()}
    x, y = w.make_batch(1)
    x = x.numpy().copy()
    x[0, 0, 0, 0] = np.nan
    assert np.isnan(step(x, y))
    after = {**step.state_dict(), **step.optimizer_state()}
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    step(*w.make_batch(1))
    written = {**step.state_dict(), **step.optimizer_state()}
    changed = {k for k, v in before.items() if not np.array_equal(written[k], v)}
    buffers = _buffers(before)
    assert set(buffers) <= changed  # every running statistic and batch count moved
    assert all(int(v) == 2 for k, v in written.items() if "num_batches" in k)


def test_gated_update_writes_all_or_nothing() -> None:
    def tensors() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        dsts = [torch.zeros(3), torch.zeros(2, 2)]
        srcs = [torch.ones(3), torch.full((2, 2), 2.0)]
        return dsts, srcs, [torch.tensor(5), torch.tensor(7)]

    dsts, srcs, counts = tensors()
    gated_update_(dsts, srcs, torch.tensor(1.0), ((counts, 1),))
    assert all(not d.any() for d in dsts) and [int(c) for c in counts] == [5, 7]
    for skip in (torch.tensor(0.0), None):
        dsts, srcs, counts = tensors()
        gated_update_(dsts, srcs, skip, ((counts, 1),))
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
        assert [int(c) for c in counts] == [6, 8]


def _bn_graph(return_var: bool) -> Any:
    b = GraphBuilder("bn")
    x = b.input("x", TensorType((2, 3, 4, 4), DType.F32))
    w = b.input("w", TensorType((3,), DType.F32), Role.PARAM, trainable=True)
    bias = b.input("b", TensorType((3,), DType.F32), Role.PARAM, trainable=True)
    y, mean, var = b.call_multi("batch_norm", x, w, bias, eps=1e-5)
    return b.build([y, mean, var] if return_var else [y, mean])


@pytest.mark.parametrize("return_var", [False, True])
def test_the_variance_is_computed_only_when_read(return_var: bool) -> None:
    backend = TorchBackend()
    exe = backend.compile(_bn_graph(return_var))
    assert (".pow(-2)" in exe.source) == return_var
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    store = {
        "w": backend.from_numpy(np.ones(3, np.float32)),
        "b": backend.from_numpy(np.zeros(3, np.float32)),
    }
    results = exe.run(store, {"x": backend.from_numpy(x)})
    if return_var:
        np.testing.assert_allclose(results[2].numpy(), x.var(axis=(0, 2, 3)), rtol=1e-5)


def test_the_full_steps_batch_norms_read_no_variance() -> None:
    """Their gradients take the 1/std the forward saved: no variance is made at all."""
    w = _mcu()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="torch")
    assert "batch_norm_backward" in step._exec.source and ".pow(-2)" not in step._exec.source


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _calls_and_source(w: zoo.Workload) -> tuple[collections.Counter[str], str]:
    step = pe.compile(
        w.model,
        w.loss_fn,
        w.make_batch(0),
        pe.optim.SGD(lr=0.01, momentum=0.9),
        zoo.benchmark_schemes("mbv2")["head"],
        backend="torch",
    )
    step(*w.make_batch(0))
    with torch.no_grad(), _Count() as count:
        step._exec.run(step._store, step._feeds(w.make_batch(1)))
    return count.calls, step._exec.source


def test_absorbed_nodes_emit_no_code(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _mcu()
    calls, source = _calls_and_source(w)
    with monkeypatch.context() as m:
        m.setattr(kernels_stats, "ABSORBERS", {})
        plain_calls, plain_source = _calls_and_source(w)
    bns = source.count("aten_native_batch_norm(")
    assert bns == 52 and plain_source.count("gated_copy_(") == 3 * bns
    # per batch norm: no mul/add of its statistics, no per-buffer copy: one update call
    assert "gated_copy_(" not in source and source.count("gated_update_(") == 1
    assert calls["aten.item.default"] == plain_calls["aten.item.default"] - 3 * bns + 1
    assert calls["aten.mul.Tensor"] == 0 and plain_calls["aten.mul.Tensor"] >= 2 * bns
    assert sum(calls.values()) < sum(plain_calls.values()) / 2
    # an absorbed node's line is its comment alone (and the deaths it causes)
    body = source.splitlines()[1:-1]
    absorbed = [line for line in body if re.match(r"\s+(pass|del [^;]+)  # ", line)]
    assert len(absorbed) >= 8 * bns


def _tracking_graph(var_factor: float, interrupted: bool) -> Any:
    """batch_norm with its running statistics as the step writes them (momentum 0.1;
    ``var_factor`` scales the biased variance), gated assigns and a batch count; with
    ``interrupted``, a node that is no part of the run between the assigns."""
    f64 = DType.F64
    b = GraphBuilder("tracking")
    x = b.input("x", TensorType((4, 3, 2, 2), f64))
    skip = b.input("skip", TensorType((), DType.F32))
    w = b.input("w", TensorType((3,), f64), Role.PARAM, trainable=True)
    bias = b.input("b", TensorType((3,), f64), Role.PARAM, trainable=True)
    rm, rv = (b.input(n, TensorType((3,), f64), Role.BUFFER) for n in ("rm", "rv"))
    count = b.input("count", TensorType((), DType.I64), Role.BUFFER)
    y, mean, var = b.call_multi("batch_norm", x, w, bias, eps=1e-5)
    stats = []
    for running, stat, factor in ((rm, mean, 0.1), (rv, var, var_factor)):
        kept = b.call("mul", running, b.scalar(0.9, f64))
        stats.append(b.call("add", kept, b.call("mul", stat, b.scalar(factor, f64))))
    b.effect("assign", rm, stats[0], skip)
    total = b.call("sum", y, axes=None, keepdims=False) if interrupted else y
    b.effect("assign", rv, stats[1], skip)
    b.effect("assign", count, b.call("add", count, b.scalar(1, DType.I64)), skip)
    return b.build([total])


@pytest.mark.parametrize("skipped", [False, True])
@pytest.mark.parametrize(("unbiased", "interrupted"), [(True, False), (True, True), (False, False)])
def test_tracked_statistics_against_their_formula(
    unbiased: bool, interrupted: bool, skipped: bool
) -> None:
    """Absorbed (ATen's factors: the unbiased variance) or not (a biased variance's factor
    is not ATen's), a run whole or cut in two: the statistics of the formula, or none
    written on a skipped step."""
    n = 16  # elements per channel
    graph = _tracking_graph(0.1 * n / (n - 1) if unbiased else 0.1, interrupted)
    backend = TorchBackend()
    exe = backend.compile(graph)
    assert ("aten_mul(" in exe.source) == (not unbiased)
    # cut in two, the run before the cut is one assign: a copy of its own
    assert exe.source.count("gated_update_(") == 1
    assert exe.source.count("gated_copy_(") == (1 if interrupted else 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 2, 2))
    rm, rv = rng.standard_normal(3), rng.random(3) + 0.5
    store = {"w": backend.from_numpy(np.ones(3)), "b": backend.from_numpy(np.zeros(3)),
             "rm": backend.from_numpy(rm), "rv": backend.from_numpy(rv),
             "count": backend.from_numpy(np.asarray(3))}  # fmt: skip
    feeds = {"x": backend.from_numpy(x), "skip": backend.from_numpy(np.float32(skipped))}
    exe.run(store, feeds)
    var = x.var(axis=(0, 2, 3), ddof=1 if unbiased else 0)
    want = (rm, rv, 3) if skipped else (0.9 * rm + 0.1 * x.mean((0, 2, 3)), 0.9 * rv + 0.1 * var, 4)
    for name, value in zip(("rm", "rv", "count"), want, strict=True):
        np.testing.assert_allclose(store[name].numpy(), value, rtol=1e-12, err_msg=name)
