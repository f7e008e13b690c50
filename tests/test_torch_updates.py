"""The torch backend's optimizer updates of small params (``kernels_update``).

With more than one intra-op thread, a param of fewer than ``SERIAL_NUMEL`` trained
elements is updated by elementwise ops on the calling thread instead of ATen's fused
kernel, which opens an OpenMP region for every tensor however small: the generated source
picks the kernel by size, and both kernels write what the NumPy reference writes (the
op samples, float32 and float64, skipped steps included) and agree over steps of a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch.backend import TorchBackend
from pockengine.backends.torch.kernels_update import SERIAL_NUMEL
from pockengine.ir import DType, Graph, GraphBuilder, Role, Sample, TensorType, get_op

Array = np.ndarray[Any, Any]
_UPDATES = ("adamw_update", "sgd_momentum_update", "sgd_update")


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _one_node(op: str, sample: Sample) -> Graph:
    """inputs x0, x1, ...; the ones the op writes are state."""
    mutates = get_op(op).mutates
    b = GraphBuilder(op)
    xs = [
        b.input(f"x{i}", TensorType(a.shape, DType.from_numpy(a.dtype)),
                Role.STATE if i in mutates else Role.INPUT)
        for i, a in enumerate(sample.inputs)
    ]  # fmt: skip
    b.call_multi(op, *xs, source="test", **sample.attrs)
    return b.build([])


def _written(op: str, sample: Sample) -> tuple[list[Array], list[Array], str]:
    """What the torch backend and the NumPy reference write, and the generated source."""
    graph = _one_node(op, sample)
    backend = TorchBackend()
    ref = {f"x{i}": np.array(a) for i, a in enumerate(sample.inputs)}
    ours = {k: backend.from_numpy(a) for k, a in ref.items()}
    NumpyBackend().compile(graph).run(ref)
    executable = backend.compile(graph)
    executable.run(ours)
    names = [f"x{i}" for i in get_op(op).mutates]
    return [backend.to_numpy(ours[n]) for n in names], [ref[n] for n in names], executable.source


def _samples(op: str, dtype: type) -> list[Sample]:
    """The op's samples in ``dtype`` (the skip flag stays float32)."""
    out = []
    for s in get_op(op).samples(np.random.default_rng(0)):  # type: ignore[misc]
        inputs: tuple[Array, ...] = tuple(
            a if a.dtype == np.float32 and a.ndim == 0 else a.astype(dtype) for a in s.inputs
        )
        out.append(Sample(inputs, s.attrs))
    return out


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-10), (np.float32, 1e-6)])
@pytest.mark.parametrize("op", _UPDATES)
def test_small_updates_on_two_threads_match_numpy(op: str, dtype: type, rtol: float) -> None:
    for sample in _samples(op, dtype):
        got, want, source = _written(op, sample)
        assert "aten_fused" not in source, source  # the small params' kernel
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol, err_msg=op)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("op", ["adamw_update", "sgd_momentum_update"])
def test_the_kernel_is_chosen_by_the_trained_size(op: str) -> None:
    """Below ``SERIAL_NUMEL`` trained elements the small kernel, from it on ATen's fused one
    (whose one region over a large tensor pays for itself); both match NumPy."""
    rng = np.random.default_rng(1)
    sample = get_op(op).samples(rng)[0]  # type: ignore[misc]
    for numel, fused in ((SERIAL_NUMEL - 1, False), (SERIAL_NUMEL, True)):
        inputs = tuple(rng.standard_normal(numel) if a.ndim else a for a in sample.inputs)
        if op == "adamw_update":  # v >= 0
            inputs = (*inputs[:3], np.abs(inputs[3]), *inputs[4:])
        got, want, source = _written(op, Sample(inputs, sample.attrs))
        assert ("aten_fused" in source) == fused, source
        assert ("_small_(" in source) != fused, source
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=op)


@pytest.mark.parametrize(
    "optimizer",
    [pe.optim.AdamW(lr=1e-3, weight_decay=0.01), pe.optim.SGD(lr=0.05, momentum=0.9,
                                                             weight_decay=1e-3, nesterov=True)],
    ids=["adamw", "sgd_momentum"],
)  # fmt: skip
def test_two_threads_train_as_one(optimizer: pe.optim.Optimizer) -> None:
    """An MLP's params and optimizer state after three steps: the small-param kernel (two
    threads) against ATen's fused one (one thread)."""
    states = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            w = zoo.mlp()
            step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer, backend="torch",
                              compile_in="process")  # fmt: skip
            assert "_small_(" in step._exec.source  # type: ignore[attr-defined]
            for i in range(3):
                step(*w.make_batch(i))
            states.append({**step.state_dict(), **step.optimizer_state()})
    finally:
        torch.set_num_threads(threads)
    one, two = states
    assert set(one) == set(two)
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
