"""PyTorch frontend: errors, buffers, BatchNorm modes, dropout, tied weights, real weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.ir import Role
from tests.torch_ref import assert_gradients_match


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.atan(self.inner(x))
        return torch.cumprod(h, dim=1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Odd()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_unsupported_ops_are_listed_at_once_with_module_paths() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(pe.UnsupportedOpError) as info:
        pe.compile(_Net(), lambda m, x: m(x).sum(), (x,))
    text = str(info.value)
    assert "2 unsupported ATen ops" in text
    assert "aten.atan.default  at block" in text
    assert "aten.cumprod.default  at block" in text


def test_batch_of_another_shape_is_a_clear_error() -> None:
    w = zoo.mlp()
    x, y = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, (x, y))
    with pytest.raises(pe.BatchError, match=r"batch entry 0: compiled for f32\[8,32\]"):
        step(x[:4], y[:4])
    with pytest.raises(pe.BatchError, match="expected 2 batch tensors"):
        step(x)


def test_loss_must_be_a_scalar() -> None:
    w = zoo.mlp()
    with pytest.raises(pe.CompileError, match="scalar"):
        pe.compile(w.model, lambda m, x, y: m(x), w.make_batch(0))


def test_roles_of_params_buffers_and_inputs() -> None:
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0))
    g = step.forward
    roles = {v.name: v.role for v in g.inputs}
    assert roles["stem.weight"] is Role.PARAM
    assert roles["bn1.running_mean"] is Role.BUFFER
    assert roles["bn1.num_batches_tracked"] is Role.BUFFER
    assert roles["batch.0"] is Role.INPUT


def test_batchnorm_running_statistics_follow_torch() -> None:
    w = zoo.small_cnn()
    model = copy.deepcopy(w.model)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.0))
    for i in range(3):
        batch = w.make_batch(i)
        step(*batch)
        with torch.no_grad():
            w.loss_fn(model, *batch)
    ours = step.state_dict()
    for name in ("bn1.running_mean", "bn1.running_var", "bn2.running_var"):
        np.testing.assert_allclose(
            ours[name], model.state_dict()[name].numpy(), rtol=1e-5, atol=1e-7
        )
    assert int(ours["bn1.num_batches_tracked"]) == 3


def test_eval_mode_batchnorm_gradients() -> None:
    w = zoo.small_cnn()
    w.model.eval()
    step = assert_gradients_match(w)
    assert "batch_norm" not in {n.op for n in step.graph.nodes}


def test_dropout_is_seeded_and_advances_each_step() -> None:
    w = zoo.small_cnn(dropout=0.5)
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, optimizer=pe.optim.SGD(lr=0.0))
    losses = [step(*batch) for _ in range(3)]
    assert len(set(losses)) == 3  # a new mask every step, the weights unchanged
    again = pe.compile(w.model, w.loss_fn, batch, optimizer=pe.optim.SGD(lr=0.0))
    assert [again(*batch) for _ in range(3)] == losses  # and the same sequence each run
    masks = [n for n in step.graph.nodes if n.op == "random_mask"]
    assert len(masks) == 1 and masks[0].attrs["p"] == 0.5


def test_tied_embeddings_share_one_value() -> None:
    w = zoo.llama_lm(tied=True)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.1))
    names = [v.name for v in step.graph.params]
    assert "lm_head.weight" not in names
    step(*w.make_batch(0))
    sd = step.state_dict()
    np.testing.assert_array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_load_into_writes_trained_values_back() -> None:
    w = zoo.mlp()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.5))
    step(*w.make_batch(0))
    step.load_into(w.model)
    for name, value in w.model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), step.state_dict()[name])


def test_frozen_requires_grad_params_get_no_gradient_node() -> None:
    w = zoo.mlp()
    for p in w.model[0].parameters():
        p.requires_grad_(False)
    step = assert_gradients_match(w)
    assert set(step.trained) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    frozen = step.graph.input_named("0.weight")
    assert not frozen.trainable
    written = {n.inputs[0].name for n in step.graph.nodes if n.op.endswith("update")}
    assert "0.weight" not in written


def test_minilm_real_weights_gradients() -> None:
    w = zoo.minilm_classifier(seq=16, batch=2)
    assert_gradients_match(w, rtol=1e-4, atol=2e-5)


def test_functional_loss_with_f_linear() -> None:
    weight = nn.Parameter(torch.randn(3, 5))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.w)

    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    w = zoo.Workload("f", M(), lambda m, x, y: F.cross_entropy(m(x), y), lambda s: (x, y))
    assert_gradients_match(w)


def test_load_state_restores_params_and_optimizer_state() -> None:
    w = zoo.mlp()
    opt = pe.optim.AdamW(lr=1e-2)
    a = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt)
    b = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt)
    for i in range(2):
        a(*w.make_batch(i))
    b.load_state(a.state_dict(), a.optimizer_state())
    assert a(*w.make_batch(5)) == b(*w.make_batch(5))
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(value, b.state_dict()[name])
    with pytest.raises(KeyError, match="not a param"):
        b.load_state({"nope": np.zeros(1)})


def test_detach_stops_the_gradient() -> None:
    """tensor.detach() (an alias after decomposition) is a stop_gradient, as in autograd."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) * m(x).detach()).sum()

    step = pe.compile(model, loss_fn, (x,))
    got = step.gradients(x)
    loss_fn(model, x).backward()
    assert any(n.op == "stop_gradient" for n in step.forward.nodes)
    for name, p in model.named_parameters():
        assert p.grad is not None
        np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-5, atol=1e-6)
