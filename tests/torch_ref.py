"""Ground truth helpers: the same model, weights and batch through torch.autograd/optim."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pockengine as pe
from pockengine.zoo import Workload


def torch_gradients(w: Workload, batch: tuple[torch.Tensor, ...]) -> tuple[float, dict[str, Any]]:
    model = copy.deepcopy(w.model)
    loss = w.loss_fn(model, *batch)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def assert_gradients_match(
    w: Workload, rtol: float = 1e-4, atol: float = 1e-5, **compile_kw: Any
) -> pe.TrainStep:
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, **compile_kw)
    ref_loss, ref = torch_gradients(w, batch)
    got = step.gradients(*batch)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=rtol, atol=atol, err_msg=name)
    loss = step(*batch)
    assert loss == np.float32(ref_loss) or abs(loss - ref_loss) <= 1e-5 + 1e-5 * abs(ref_loss)
    return step


def assert_training_matches(
    w: Workload,
    optimizer: pe.optim.Optimizer,
    torch_opt: Callable[[Any], torch.optim.Optimizer],
    steps: int = 3,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    **compile_kw: Any,
) -> None:
    """``steps`` updates in PockEngine and in torch.optim leave equal params and buffers."""
    model = copy.deepcopy(w.model)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=optimizer, **compile_kw)
    opt = torch_opt(model.parameters())
    for i in range(steps):
        batch = w.make_batch(i)
        opt.zero_grad()
        ref = w.loss_fn(model, *batch)
        ref.backward()
        opt.step()
        loss = step(*batch)
        assert abs(loss - float(ref)) <= atol + rtol * abs(float(ref)) * 10, (i, loss, float(ref))
    ours = step.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=rtol, atol=atol, err_msg=name)
