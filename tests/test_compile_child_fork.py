"""``pe.compile(..., compile_in="child")``: the compile runs in a forked child
(``pockengine.step.child``) and this process binds the step it wrote.

- the step trains bit-identically to the one compiled in process (losses, trained state,
  gradients) on the NumPy, torch and C backends, and shares the module's frozen weights
  (they are bound by name, not written and read back);
- the child's errors arrive as the class and message they had (an unsupported ATen op,
  named), a non-engine error as a CompileError naming its type, a child that dies or
  hangs as a CompileError; its warnings and log records are emitted here;
- this process keeps none of torch.export's leftovers (no ``torch.fx.GraphModule``);
- ``compile_mode`` refuses what cannot fork and bad values, and ``PE_COMPILE_IN`` sets
  the default.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.ir import CompileError, UnsupportedOpError
from pockengine.step import child as compile_fork
from pockengine.step.child import compile_mode


def _compiled(mode: str, backend: str, name: str = "small_cnn", **kw: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    work = getattr(zoo, name)()
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), backend=backend,
                      compile_in=mode, **kw)  # fmt: skip
    return step, work


@pytest.mark.parametrize("backend", ["numpy", "torch", "c"])
def test_child_trains_bit_identically(backend: str) -> None:
    name = "mlp" if backend == "c" else "small_cnn"  # C: the cheapest source to build
    runs = {}
    for mode in ("process", "child"):
        step, work = _compiled(mode, backend, name, optimizer=pe.optim.AdamW(lr=1e-2))
        batches = [work.make_batch(k) for k in range(3)]
        losses = [step(*b) for b in batches]
        runs[mode] = (losses, step.state_dict(), step.optimizer_state(),
                      step.gradients(*batches[0]))  # fmt: skip
    (want, *wanted), (got, *gotten) = runs["process"], runs["child"]
    assert got == want
    for expected, actual in zip(wanted, gotten, strict=True):
        assert actual.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_onnx_model_compiles_in_a_child(tmp_path: Path) -> None:
    from tests.test_onnx_frontend import export

    work = zoo.mlp()
    batch = work.make_batch(0)
    path = export(work.model, batch[:1], tmp_path / "mlp.onnx", "torchscript")
    steps = [pe.compile(str(path), loss="cross_entropy", example_batch=batch, compile_in=mode)
             for mode in ("process", "child")]  # fmt: skip
    losses = [[s(*work.make_batch(k)) for k in range(2)] for s in steps]
    assert losses[1] == losses[0]
    want, got = (s.state_dict() for s in steps)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_child_binds_the_modules_frozen_weights() -> None:
    work = zoo.mlp()
    work.model[0].weight.requires_grad_(False)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), compile_in="child")
    assert "0.weight" not in step.written
    ir = next(k for k, v in step._state_names.items() if v == "0.weight")
    assert np.shares_memory(step._store[ir], work.model[0].weight.detach().numpy())


def test_saves_reports_and_loads_like_the_in_process_step(tmp_path: Any) -> None:
    step, work = _compiled("child", "numpy", "mlp")
    ours, theirs = step.report(), _compiled("process", "numpy", "mlp")[0].report()
    assert str(ours) == str(theirs)
    batch = work.make_batch(0)
    loaded = pe.load_step(step.save(tmp_path / "step"))
    assert loaded(*batch) == step(*batch)


class _Cumprod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(self.fc(x), dim=1)


def _cumprod_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_unsupported_op_arrives_as_the_same_error() -> None:
    batch = (torch.randn(2, 4),)
    errors = []
    for mode in ("process", "child"):
        with pytest.raises(UnsupportedOpError) as caught:
            pe.compile(_Cumprod(), _cumprod_loss, batch, compile_in=mode)
        errors.append(caught.value)
    assert "aten.cumprod.default" in str(errors[1])
    assert str(errors[1]) == str(errors[0])
    assert errors[1].entries == errors[0].entries


class _BrokenSGD(pe.optim.SGD):
    def _emit(self, *args: Any) -> None:
        raise LookupError("no such thing")


def test_other_errors_name_their_type() -> None:
    work = zoo.mlp()
    with pytest.raises(CompileError, match="LookupError: no such thing") as caught:
        pe.compile(work.model, work.loss_fn, work.make_batch(0), _BrokenSGD(), compile_in="child")
    assert any("in _emit" in note for note in caught.value.__notes__)  # the child's traceback


class _ChildWarning(UserWarning):
    pass


def test_warnings_and_log_records_are_emitted_here(caplog: pytest.LogCaptureFixture) -> None:
    work = zoo.mlp()

    def loss_fn(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        warnings.warn("traced in the child", _ChildWarning, stacklevel=1)
        return work.loss_fn(model, *batch)

    budget = "pockengine.passes.remat_budget"
    with caplog.at_level(logging.WARNING, logger=budget), pytest.warns(_ChildWarning):
        pe.compile(work.model, loss_fn, work.make_batch(0), compile_in="child",
                   memory_budget=64)  # fmt: skip
    assert "not met" in caplog.text  # the budget pass logged it in the child


# In a fresh interpreter (this one may hold an earlier compile's leftovers): the torch.fx
# GraphModules alive after a child compile and a step, then after an in-process compile.
_LEFTOVERS = """
import gc, json, torch, pockengine as pe
from pockengine import zoo

def graph_modules():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.fx.GraphModule))

work = zoo.mlp()
batch = work.make_batch(0)
step = pe.compile(work.model, work.loss_fn, batch)  # the default: a forked child
step(*batch)
counts = [graph_modules()]
pe.compile(work.model, work.loss_fn, batch, compile_in="process")
print(json.dumps(counts + [graph_modules()]))
"""


def test_this_process_keeps_nothing_of_torch_export() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PE_COMPILE_IN"}  # conftest pins it
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", _LEFTOVERS], capture_output=True, text=True,
                         check=True, env=env, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    child, in_process = json.loads(out.stdout.splitlines()[-1])
    assert child == 0
    assert in_process > 0  # what the child spared this process


class _Cycle:
    def __init__(self, step: Any) -> None:
        self.step, self.me = step, self


def test_garbage_with_unforkable_destructors_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ONNX Runtime session in uncollected garbage: freed in the child, its destructor
    would wait forever for its thread pool, which the child does not have."""
    work = zoo.mlp()
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, backend="onnxruntime")
    step(*batch)
    gc.collect()
    _Cycle(step)  # garbage only a collection frees
    del step
    monkeypatch.setattr(compile_fork, "TIMEOUT_S", 60.0)
    monkeypatch.delenv("PE_COMPILE_TIMEOUT", raising=False)
    child = pe.compile(work.model, work.loss_fn, batch, backend="onnxruntime", compile_in="child")
    assert np.isfinite(child(*batch))


def test_a_child_that_dies_is_a_compile_error() -> None:
    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        os._exit(3)

    with pytest.raises(CompileError, match="exited with status 3"):
        pe.compile(nn.Linear(4, 3), loss_fn, (torch.randn(2, 4),), compile_in="child")


def test_a_child_that_hangs_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        time.sleep(60)
        return model(x).sum()

    monkeypatch.setattr(compile_fork, "TIMEOUT_S", 0.5)
    monkeypatch.delenv("PE_COMPILE_TIMEOUT", raising=False)
    start = time.monotonic()
    with pytest.raises(CompileError, match=r"did not finish in 0\.5 s"):
        pe.compile(nn.Linear(4, 3), loss_fn, (torch.randn(2, 4),), compile_in="child")
    assert time.monotonic() - start < 30


def test_compile_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PE_COMPILE_IN", raising=False)
    # no JAX runtime or TensorFlow here (other tests in this process may have loaded them)
    monkeypatch.setattr(compile_fork, "_threaded_runtime", lambda: False)
    assert compile_fork.DEFAULT_COMPILE_IN == "child"
    assert compile_mode(None, "torch") == compile_mode(None, "onnx") == "child"
    assert compile_mode(None, "jax") == compile_mode(None, "keras") == "process"
    assert compile_mode("child", "onnx") == "child"
    with pytest.raises(CompileError, match="jax frontend compiles in process only"):
        compile_mode("child", "jax")
    assert compile_mode("process", "jax") == "process"
    with pytest.raises(CompileError, match="compile_in must be one of"):
        compile_mode("thread", "torch")
    monkeypatch.setenv("PE_COMPILE_IN", "process")
    assert compile_mode(None, "torch") == "process"
    monkeypatch.setenv("PE_COMPILE_IN", "child")
    assert compile_mode(None, "keras") == "process"  # a default that cannot fork: here
    monkeypatch.setattr(compile_fork, "_threaded_runtime", lambda: True)  # TF or JAX running
    assert compile_mode(None, "torch") == "process"
    assert compile_mode("child", "torch") == "child"  # asked for: forks all the same
    monkeypatch.setenv("PE_COMPILE_IN", "fork")
    with pytest.raises(CompileError, match="PE_COMPILE_IN must be one of"):
        compile_mode(None, "torch")


def test_a_loaded_tensorflow_counts_as_a_threaded_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", sys)  # stands for a loaded TensorFlow
    assert compile_fork._threaded_runtime()


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_a_bad_timeout_is_a_clear_error_before_any_fork(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PE_COMPILE_TIMEOUT", value)
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked with a bad timeout"))
    with pytest.raises(CompileError, match=f"PE_COMPILE_TIMEOUT must be .*{value!r}"):
        pe.compile(nn.Linear(4, 3), lambda m, x: m(x).sum(), (torch.randn(2, 4),),
                   compile_in="child")  # fmt: skip
