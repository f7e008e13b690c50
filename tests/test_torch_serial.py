"""The torch backend's one-thread kernels (``backends/torch/serial.py``): batch norm, its
gradient and the fused optimizer updates run through ``pe_serially`` where compiling
measured one thread faster; the results are the NumPy reference's either way, and the
thread count is what it was after every call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch import serial

_SERIAL_CALLS = (
    "pe_serially(aten_native_batch_norm,",
    "pe_serially(aten_native_batch_norm_backward,",
)


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _choose(monkeypatch: pytest.MonkeyPatch, one_thread: bool) -> list[serial.Probe]:
    """Every measurement answers ``one_thread`` after running its probe once; the probes
    measured, in order (a fresh cache)."""
    measured: list[serial.Probe] = []

    def answer(probe: serial.Probe) -> bool:
        probe()
        measured.append(probe)
        return one_thread

    monkeypatch.setattr(serial, "_CHOICES", {})
    monkeypatch.setattr(serial, "_one_thread_faster", answer)
    return measured


def test_serially_runs_on_one_thread_and_restores_the_threads(two_threads: None) -> None:
    seen: list[int] = []

    def add(a: int, b: int = 0) -> int:
        seen.append(torch.get_num_threads())
        return a + b

    assert serial.serially(add, 2, b=3) == 5
    assert seen == [1] and torch.get_num_threads() == 2

    def fail() -> None:
        raise ValueError("kernel failed")

    with pytest.raises(ValueError, match="kernel failed"):
        serial.serially(fail)
    assert torch.get_num_threads() == 2


_OPTIMIZERS: dict[str, Callable[[], pe.optim.Optimizer]] = {
    "sgd_momentum": lambda: pe.optim.SGD(lr=0.05, momentum=0.9),
    "sgd": lambda: pe.optim.SGD(lr=0.05),
    "adamw": lambda: pe.optim.AdamW(lr=1e-3, weight_decay=0.01, eps=1e-5),
}


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_kernels_on_one_thread_train_as_numpy(
    optimizer: str, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = _choose(monkeypatch, one_thread=True)
    w = zoo.small_cnn()
    batch = w.make_batch(0)
    make = _OPTIMIZERS[optimizer]
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=make(), backend="numpy")
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=make(), backend="torch")
    source = ours._exec.source
    update = "aten_fused_adamw_" if optimizer == "adamw" else "aten_fused_sgd_"
    assert all(call in source for call in (*_SERIAL_CALLS, f"pe_serially({update},"))
    assert measured and "aten_native_batch_norm(" not in source
    for i in range(3):
        batch = w.make_batch(i)
        assert ours(*batch) == pytest.approx(ref(*batch), rel=1e-4, abs=1e-5)
        assert torch.get_num_threads() == 2
    want, got = ref.state_dict(), ours.state_dict()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_partial_channel_updates_are_probed_on_the_part_they_write(
    optimizer: str, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update of a weight's first rows (``channels=``): the probe's stand-in param has
    the gradient's rows, as the generated call passes the param's narrowed view (a stand-in
    of the whole param made ATen's fused kernels read past the gradient's end)."""
    monkeypatch.setattr(serial, "_CHOICES", {})  # measured for real, afresh
    w = zoo.small_cnn()
    batch = w.make_batch(0)
    scheme = pe.schemes.full(channels={"*weight": 0.5})
    make = _OPTIMIZERS[optimizer]
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=make(), scheme=scheme, backend="numpy")
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=make(), scheme=scheme, backend="torch")
    assert any(n.attrs.get("rows") for n in ours.graph.nodes)
    update = "aten_fused_adamw_" if optimizer == "adamw" else "aten_fused_sgd_"
    assert any(key[0] == update for key in serial.choices())
    for i in range(2):
        batch = w.make_batch(i)
        assert ours(*batch) == pytest.approx(ref(*batch), rel=1e-4, abs=1e-5)
    want, got = ref.state_dict(), ours.state_dict()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_choice_is_measured_once_per_kernel_and_shapes(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = _choose(monkeypatch, one_thread=False)
    w = zoo.small_cnn()
    batch = w.make_batch(0)
    sgd = pe.optim.SGD(lr=0.1, momentum=0.9)
    first = pe.compile(w.model, w.loss_fn, batch, optimizer=sgd, backend="torch")
    assert "pe_serially(" not in first._exec.source
    keys = serial.choices()
    assert len(measured) == len(keys) > 0
    assert {key[0] for key in keys} == {
        "aten_native_batch_norm",
        "aten_native_batch_norm_backward",
        "aten_fused_sgd_",
    }
    pe.compile(w.model, w.loss_fn, batch, optimizer=sgd, backend="torch")
    assert len(measured) == len(keys)  # the second compile measures nothing


def test_one_thread_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = _choose(monkeypatch, one_thread=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = zoo.small_cnn()
        step = pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="torch")
    finally:
        torch.set_num_threads(threads)
    assert not measured and "pe_serially(" not in step._exec.source


def _sleeps_on(threads_that_sleep: Callable[[int], bool], calls: list[int]) -> serial.Probe:
    """A probe that sleeps 2 ms when ``threads_that_sleep(threads)``, else returns."""

    def probe() -> None:
        calls.append(torch.get_num_threads())
        if threads_that_sleep(torch.get_num_threads()):
            time.sleep(0.002)

    return probe


def test_the_faster_thread_count_is_chosen(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serial, "LARGE_S", 1.0)
    calls: list[int] = []
    assert serial._one_thread_faster(_sleeps_on(lambda n: n > 1, calls))
    assert calls.count(2) == serial.ROUNDS + 1 and calls.count(1) == serial.ROUNDS + 2
    assert not serial._one_thread_faster(_sleeps_on(lambda n: n == 1, []))


def test_a_large_kernel_stays_on_all_threads_timed_twice(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serial, "LARGE_S", 1e-3)
    calls: list[int] = []
    assert not serial._one_thread_faster(_sleeps_on(lambda n: True, calls))
    assert calls == [2, 1, 1]  # one warm-up on all threads, two timings on one
