"""What the torch and C backends hold beyond the plan, with results unchanged.

- torch: frozen weights, 4-D convolution weights included, are the model's own memory in
  the layout they arrive in (``frozen_channels_last`` copies them channels-last instead);
  trained ones are channels-last copies; convolutions run on either and the step matches
  the NumPy backend, gradients through the frozen convolutions included;
- torch: ``from_numpy`` copies once (a read-only array too), 0-d arrays stay 0-d;
- torch: the heap trim after each run is opt-in, ``keep_heap`` turns it off;
- C: frozen weights are shared read-only, trained ones copied into the state block, the
  heap is trimmed when built and after the first step; the batch is copied only into
  the arena; the step matches the NumPy backend.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend
from pockengine.backends.c import backend as c_backend
from pockengine.backends.torch import backend as torch_backend
from pockengine.backends.torch.backend import TorchBackend

Array = np.ndarray[Any, Any]

# stem's weight trains, so the backward runs through the frozen dw and pw convolutions
_TRAIN = ["stem.*", "fc.*", "*bias"]
_FROZEN_4D = ("dw.weight", "pw.weight")


def _sgd() -> pe.optim.Optimizer:
    return pe.optim.SGD(lr=0.05, momentum=0.9)


def _address(value: Any) -> int:
    return int(value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data)


def _compile(w: zoo.Workload, backend: Any) -> pe.TrainStep:
    scheme = pe.schemes.select(train=_TRAIN)
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), _sgd(), scheme, backend=backend)


def _assert_same_training(step: pe.TrainStep, reference: pe.TrainStep, w: zoo.Workload) -> None:
    grads, want = step.gradients(*w.make_batch(0)), reference.gradients(*w.make_batch(0))
    assert set(grads) == set(want) and "stem.weight" in grads
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
    for i in range(3):
        batch = w.make_batch(i)
        assert step(*batch) == pytest.approx(reference(*batch), rel=1e-5, abs=1e-6)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frozen_channels_last", [False, True])
def test_torch_frozen_conv_weights_keep_their_layout(frozen_channels_last: bool) -> None:
    w = zoo.small_cnn()
    params = dict(w.model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    step = _compile(w, TorchBackend(frozen_channels_last=frozen_channels_last))
    store = step._store
    for name in _FROZEN_4D:
        shared = _address(store[name]) == params[name].data_ptr()
        assert shared != frozen_channels_last, name
        layout = torch.channels_last if frozen_channels_last else torch.contiguous_format
        assert store[name].is_contiguous(memory_format=layout), name
    trained = store["stem.weight"]
    assert trained.is_contiguous(memory_format=torch.channels_last)
    assert not trained.is_contiguous()
    assert _address(trained) != params["stem.weight"].data_ptr()
    _assert_same_training(step, _compile(zoo.small_cnn(), "numpy"), w)
    for name, value in params.items():  # training never writes the user's model
        assert torch.equal(value.detach(), before[name]), name


def test_torch_from_numpy_copies_read_only_arrays_once_and_keeps_their_shape() -> None:
    backend = TorchBackend()
    assert backend.from_numpy(np.asarray(3, dtype=np.int64)).shape == ()
    frozen = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    frozen.flags.writeable = False
    copied = backend.from_numpy(frozen)
    assert copied.is_contiguous(memory_format=torch.channels_last)
    copied.add_(1)  # the backend's own memory: the caller's array is untouched
    assert frozen[0, 0, 0, 0] == 0 and copied[0, 0, 0, 0] == 1
    shared = backend.share_numpy(frozen)
    assert shared.data_ptr() == frozen.ctypes.data and shared.is_contiguous()


def _trim_counter(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Replace ``module.libc_function("malloc_trim")`` by a counter of its calls."""
    calls: list[int] = []
    real: Callable[[str], Any] = module.libc_function

    def fake(name: str) -> Any:
        return (lambda pad: calls.append(pad) or 1) if name == "malloc_trim" else real(name)

    monkeypatch.setattr(module, "libc_function", fake)
    return calls


def test_torch_heap_trim_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _trim_counter(monkeypatch, torch_backend)
    monkeypatch.setattr(torch_backend, "keep_freed_heap", lambda: True)  # process-wide: not here
    w = zoo.small_cnn()
    plain = _compile(w, TorchBackend())
    for i in range(2):
        plain(*w.make_batch(i))
    assert calls == []
    assert not TorchBackend(trim_heap=True, keep_heap=True).trim_heap
    assert not TorchBackend("meta", trim_heap=True).trim_heap  # the C heap is the CPU's
    trimmed = _compile(zoo.small_cnn(), TorchBackend(trim_heap=True))
    _assert_same_training(trimmed, _compile(zoo.small_cnn(), "numpy"), w)
    assert len(calls) == 1 + 3 and set(calls) == {0}  # gradients(), then one per step


def test_torch_heap_trim_runs_for_real() -> None:
    w = zoo.small_cnn()
    trimmed = _compile(w, TorchBackend(trim_heap=True))
    plain = _compile(zoo.small_cnn(), TorchBackend())
    for i in range(2):
        assert trimmed(*w.make_batch(i)) == plain(*w.make_batch(i))


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                    reason="no C compiler (cc or $CC)")  # fmt: skip
def test_c_shares_frozen_weights_and_trims_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _trim_counter(monkeypatch, c_backend)
    w = zoo.small_cnn()
    params = dict(w.model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    step = _compile(w, CBackend())
    store = step._store
    for name in _FROZEN_4D:
        assert _address(store[name]) == params[name].data_ptr(), name
        assert not store[name].flags.writeable, name
    for name in ("stem.weight", "fc.weight", "fc.bias"):
        assert store[name].flags.owndata and store[name].flags.writeable, name
    _assert_same_training(step, _compile(zoo.small_cnn(), "numpy"), w)
    # twice per executable (the gradient graph's, the step's): built, and after its first run
    assert calls == [0, 0, 0, 0]
    for name, value in params.items():
        assert torch.equal(value.detach(), before[name]), name


def test_c_step_copies_the_batch_only_into_its_arena() -> None:
    """The batch goes straight into the arena: no backend copy of it per call (a
    batch-sized temporary that the heap would keep after the first step)."""
    import tracemalloc

    w = zoo.small_cnn()
    step = _compile(w, CBackend())
    batch = [b.numpy() for b in w.make_batch(0)]
    step(*batch)
    batch_bytes = sum(b.nbytes for b in batch)
    tracemalloc.start()
    try:
        step(*batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch_bytes > 8192 and peak < batch_bytes / 2, (peak, batch_bytes)
