"""``pe.compile(..., in_place=True)``: the step trains the torch module's own tensors.

- on numpy, torch and C, compiled in process and in a child: after every step the
  module holds the step's params and buffers, bit for bit those of a step that copies;
- the module's tensors are the step's memory (no copy), except where a backend cannot
  share one: then it is copied, named with its reason in a warning and ``step.in_place``,
  and written back after every step;
- a step with a NaN loss leaves the module as it was; ``load_state`` writes into the
  module; a model that is not a torch module is refused.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch.backend import TorchBackend

BACKENDS = ("numpy", "torch", "c")


def _module_state(model: nn.Module) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _pair(backend: Any, compile_in: str = "process") -> tuple[Any, Any, Any, Any]:
    """The small CNN compiled twice (SGD with momentum): copying, and in place on its own
    module; returns (copying step, in-place step, in-place module, workload)."""
    work = zoo.small_cnn()
    batch = work.make_batch(0)
    optimizer = pe.optim.SGD(lr=0.05, momentum=0.9)
    copied = pe.compile(copy.deepcopy(work.model), work.loss_fn, batch, optimizer,
                        backend=backend, compile_in=compile_in)  # fmt: skip
    in_place = pe.compile(work.model, work.loss_fn, batch, optimizer, backend=backend,
                          compile_in=compile_in, in_place=True)  # fmt: skip
    return copied, in_place, work.model, work


def _assert_module_is_step(model: nn.Module, step: Any) -> None:
    state = step.flat_state_dict()
    module = _module_state(model)
    for name, value in state.items():
        np.testing.assert_array_equal(module[name], value, err_msg=name)


@pytest.mark.parametrize(
    ("backend", "compile_in"),
    [("numpy", "process"), ("torch", "process"), ("c", "process"), ("c", "child")],
)
def test_module_holds_the_trained_values_bit_for_bit(backend: str, compile_in: str) -> None:
    copied, in_place, model, work = _pair(backend, compile_in)
    before = _module_state(model)
    for i in range(3):
        batch = work.make_batch(i)
        assert in_place(*batch) == copied(*batch)
        _assert_module_is_step(model, in_place)
    for name, value in copied.flat_state_dict().items():
        np.testing.assert_array_equal(in_place.flat_state_dict()[name], value, err_msg=name)
    after = _module_state(model)
    assert any(not np.array_equal(before[n], after[n]) for n in in_place.trained)
    fresh = copy.deepcopy(model)
    in_place.load_into(fresh)  # still works, and agrees
    for name, value in _module_state(fresh).items():
        np.testing.assert_array_equal(value, _module_state(model)[name])


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_every_written_value_is_the_modules_memory(backend: str) -> None:
    _, step, model, _ = _pair(backend)
    report = step.in_place
    assert report is not None and not report.written_back and not report.held
    assert set(report.shared) == set(step.written)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    lent = step.flat_state_dict(step.written, copy=False)
    for name in step.written:
        assert np.shares_memory(lent[name], tensors[name].detach().numpy()), name
    bias = next(n for n in step.trained if n.endswith("bias"))
    with torch.no_grad():  # as with a torch optimizer, an edit of the module is the step's
        tensors[bias].add_(1.0)
    np.testing.assert_array_equal(step.state_dict()[bias], tensors[bias].detach().numpy())


def test_torch_backend_shares_all_but_its_channels_last_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pockengine.step.compiler"):
        copied, step, model, work = _pair("torch")
    report = step.in_place
    four_d = {n for n in step.written if _module_state(model)[n].ndim == 4}
    assert four_d and set(report.written_back) == four_d
    assert all("channels-last" in why for why in report.written_back.values())
    assert "written back after every step" in caplog.text and "channels-last" in caplog.text
    shared = set(step.written) - four_d
    assert set(report.shared) == shared
    for name, tensor in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        if name in shared:
            assert tensor.data_ptr() == step._store[_ir(step, name)].data_ptr(), name
    for i in range(2):
        assert step(*work.make_batch(i)) == copied(*work.make_batch(i))
        _assert_module_is_step(model, step)
    _, flat, _, _ = _pair(TorchBackend(channels_last=False))
    assert flat.in_place is not None and set(flat.in_place.shared) == set(flat.written)


def _ir(step: Any, name: str) -> str:
    return str(next(ir for ir, model_name in step._state_names.items() if model_name == name))


class _Transposed(nn.Module):
    """A linear layer whose weight is a non-contiguous view (a transpose)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(6, 4).t())  # [4, 6], column-major
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def test_non_contiguous_param_is_copied_and_written_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _Transposed()
    x, y = torch.randn(3, 4), torch.randn(3, 6)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x)
        return ((out - y) ** 2).mean()

    with caplog.at_level(logging.WARNING, logger="pockengine.step.compiler"):
        step = pe.compile(model, loss_fn, (x, y), pe.optim.SGD(lr=0.1), backend="c",
                          compile_in="process", in_place=True)  # fmt: skip
    assert step.in_place is not None
    assert step.in_place.shared == ("bias",)
    assert "contiguous" in step.in_place.written_back["weight"]
    assert "weight" in caplog.text
    before = model.weight.detach().clone()
    step(x, y)
    assert not torch.equal(model.weight.detach(), before)
    _assert_module_is_step(model, step)


def test_backend_that_keeps_its_own_copies_writes_back(caplog: pytest.LogCaptureFixture) -> None:
    work = zoo.mlp()
    batch = work.make_batch(0)
    optimizer = pe.optim.AdamW(lr=0.01)
    copied = pe.compile(copy.deepcopy(work.model), work.loss_fn, batch, optimizer,
                        backend="onnxruntime", compile_in="process")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pockengine.step.compiler"):
        step = pe.compile(work.model, work.loss_fn, batch, optimizer, backend="onnxruntime",
                          compile_in="process", in_place=True)  # fmt: skip
    assert step.in_place is not None and step.in_place.shared == ()
    assert set(step.in_place.written_back) == set(step.written)
    assert "onnxruntime backend keeps its own copy" in caplog.text
    for i in range(2):
        assert step(*work.make_batch(i)) == copied(*work.make_batch(i))
        _assert_module_is_step(work.model, step)
    for name, value in copied.flat_state_dict().items():
        np.testing.assert_array_equal(step.flat_state_dict()[name], value, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_step_leaves_the_module_unchanged(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x)
        return ((out - y) ** 2).mean()

    step = pe.compile(model, loss_fn, (x, y), pe.optim.SGD(lr=0.1, momentum=0.9),
                      backend=backend, compile_in="process", in_place=True)  # fmt: skip
    step(x, y)
    before, momenta = _module_state(model), step.optimizer_state()
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(pe.NonFiniteError):
        step(bad, y)
    for name, value in _module_state(model).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    for name, value in step.optimizer_state().items():
        np.testing.assert_array_equal(value, momenta[name], err_msg=name)
    _assert_module_is_step(model, step)


def test_load_state_writes_into_the_module() -> None:
    _, step, model, work = _pair("numpy")
    start = step.state_dict()
    step(*work.make_batch(0))
    step.load_state(start)
    for name, value in _module_state(model).items():
        np.testing.assert_array_equal(value, start[name], err_msg=name)


def test_a_model_without_torch_tensors_is_refused() -> None:
    with pytest.raises(pe.CompileError, match="in_place=True trains a torch module"):
        pe.compile("model.onnx", loss="mse", in_place=True)


@pytest.mark.parametrize("value", ["no", "false", 1, None])
def test_in_place_takes_only_a_bool(value: Any) -> None:
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pe.CompileError, match="in_place must be True or False"):
        pe.compile(model, lambda m, x: m(x).sum(), (torch.randn(2, 3),), in_place=value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
