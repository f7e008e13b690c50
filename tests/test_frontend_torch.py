"""PyTorch frontend: errors, buffers, BatchNorm modes, dropout, tied weights, real weights."""

from __future__ import annotations

import copy
import warnings

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
    with pytest.raises(pe.StateError, match=r"1 unexpected \(nope\)"):
        b.load_state({**a.state_dict(), "nope": np.zeros(1)})


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


# -- ops that real models need (issue 15): each against torch.autograd -------------------


class _Layout(nn.Module):
    """One op of interest, ``kind``, between two trained linear layers."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # [4, 6]
        if self.kind == "pow":  # aten.pow.Tensor_Tensor: positive base, trained exponent
            h = torch.pow(self.scale, torch.tanh(h))
        elif self.kind == "pow_scalar_base":  # aten.pow.Scalar
            h = torch.pow(2.0, h * self.scale)
        elif self.kind == "repeat":
            h = h.repeat(2, 1, 1).sum(0) + h.repeat(1, 2)[:, 3:9]
        elif self.kind == "adaptive_pool":  # Swin's pooler: as_strided on a mean
            h = F.adaptive_avg_pool1d(h.reshape(4, 2, 3).transpose(1, 2), 1).reshape(4, 3)
            h = torch.cat([h, h * self.scale[:3]], dim=1)
        elif self.kind == "as_strided_transpose":
            h = torch.as_strided(h.contiguous(), (6, 4), (1, 6)).t() * self.scale
        elif self.kind == "slice_scatter":  # shift right, as T5 and BART's decoder inputs
            shifted = torch.zeros_like(h)
            shifted[:, 1:] = h[:, :-1]
            h = shifted * self.scale
        return self.out(h)


def _layout_workload(kind: str) -> zoo.Workload:
    torch.manual_seed(0)

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    return zoo.Workload(kind, _Layout(kind), lambda m, x, y: F.cross_entropy(m(x), y), make)


@pytest.mark.parametrize(
    "kind",
    ["pow", "pow_scalar_base", "repeat", "adaptive_pool", "as_strided_transpose", "slice_scatter"],
)
def test_layout_and_power_ops_match_autograd(kind: str) -> None:
    assert_gradients_match(_layout_workload(kind))


def test_bce_with_logits_uses_log1p_and_matches_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(4, 5) * 8, (torch.rand(4, 3) > 0.5).float()  # large logits: tiny log1p
    w = zoo.Workload("bce", model, lambda m, a, b: F.binary_cross_entropy_with_logits(m(a), b),
                     lambda seed: (x, y))  # fmt: skip
    step = assert_gradients_match(w)
    assert "log1p" in {n.op for n in step.forward.nodes}


def test_overlapping_as_strided_is_a_clear_error() -> None:
    model = nn.Linear(6, 6)
    x = torch.randn(4, 6)
    windows = lambda m, a: torch.as_strided(m(a).contiguous(), (4, 3, 2), (6, 1, 1)).sum()  # noqa: E731
    with pytest.raises(
        pe.CompileError, match=r"as_strided .* size \[4, 3, 2\], stride \[6, 1, 1\]"
    ):
        pe.compile(model, windows, (x,))


def test_attention_broadcasts_one_key_value_head() -> None:
    """Falcon's multi-query attention: k and v of one head for every query head."""

    class MQA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.kv = nn.Linear(8, 16), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).reshape(2, 5, 4, 4).transpose(1, 2)
            k, v = self.kv(x).reshape(2, 5, 2, 4).permute(2, 0, 1, 3).unsqueeze(2)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1).mean(-1)

    torch.manual_seed(0)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5)
    w = zoo.Workload("mqa", MQA(), lambda m, a, b: F.mse_loss(m(a), b), lambda seed: (x, y))
    assert_gradients_match(w)


def test_compiling_shows_no_torch_internal_deprecation() -> None:
    """torch.export's own LeafSpec deprecation is filtered at the export, nowhere else."""
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pe.compile(model, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
        warnings.warn("still shown", FutureWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert not any("LeafSpec" in m for m in messages), messages
    assert "still shown" in messages  # the filter is scoped: the caller's filters are intact
