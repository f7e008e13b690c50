"""NaN goes where the NumPy reference sends it on the C backend's elementwise ops.

A NaN in a batch must reach the loss on every backend, so that the step's non-finite gate
refuses the update (``NonFiniteError``) instead of training on a value an activation
silently turned into 0. Every claimed sample of an elementwise op is run with a NaN in
the first element of each float input; the NaN positions of the results must be
NumPy's."""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine.backends.c import CBackend
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import ELEMENTWISE, GraphBuilder, Sample, get_op
from tests.test_c_backend import _CLAIMED, _add_case, _ident

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_ELEMENTWISE = [c for c in _CLAIMED if ELEMENTWISE in get_op(c[1].name).facts]


def _with_nan(sample: Sample) -> Sample:
    inputs = tuple(np.array(a) for a in sample.inputs)
    for a in inputs:
        if a.dtype.kind == "f" and a.size:
            a.reshape(-1)[0] = np.nan
    return Sample(inputs, dict(sample.attrs))


def test_there_are_elementwise_samples() -> None:
    assert {"relu", "add", "mul"} <= {c[1].name for c in _ELEMENTWISE}


@pytest.mark.parametrize("label", [c[0] for c in _ELEMENTWISE])
def test_nan_propagates_as_in_numpy(label: str) -> None:
    _, opdef, sample = next(c for c in _ELEMENTWISE if c[0] == label)
    sample = _with_nan(sample)
    b = GraphBuilder("nan")
    graph = b.build(_add_case(b, label, opdef, sample))
    feeds = {f"{_ident(label)}.x{i}": a for i, a in enumerate(sample.inputs)}
    with np.errstate(all="ignore"):
        got = CBackend().compile(graph).run({k: np.array(v) for k, v in feeds.items()}, {})
        want = NumpyBackend().compile(graph).run({k: np.array(v) for k, v in feeds.items()})
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype.kind == "f":
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=label)


def test_a_nan_pixel_through_relu_stops_the_step() -> None:
    import torch

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x), y)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5))  # fmt: skip
    x = torch.randn(2, 3, 8, 8)
    y = torch.tensor([1, 3])
    step = pe.compile(model, loss_fn, (x, y), pe.optim.SGD(lr=0.1), backend="c",
                      compile_in="process")  # fmt: skip
    before = step.state_dict()
    x[0, 0, 4, 4] = float("nan")
    with pytest.raises(pe.NonFiniteError):
        step(x, y)
    after = step.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
