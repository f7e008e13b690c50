"""Scaled dot-product attention as one IR op: the torch frontend keeps SDPA whole, the
backward recomputes probabilities from the saved log-sum-exp, and every backend agrees
with torch.autograd."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.backends.numpy.backend import evaluate
from pockengine.ir import GraphBuilder, TensorType, VJPContext, get_op
from pockengine.ir.types import DType
from tests.torch_ref import assert_gradients_match, torch_gradients


class _Attend(nn.Module):
    """Projections around one F.scaled_dot_product_attention call."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, dim: int = 32, **sdpa: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head)
        self.out = nn.Linear(dim, 3)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.sdpa)
        logits: torch.Tensor = self.out(h.transpose(1, 2).reshape(b, n, -1).mean(1))
        return logits


def _workload(model: nn.Module, mask: torch.Tensor | None) -> zoo.Workload:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 6, 32, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (2,), generator=g)
        return (x, y) if mask is None else (x, mask, y)

    def loss(m: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(*batch[:-1]), batch[-1])

    return zoo.Workload("attend", model.double(), loss, make)


def _padding(dtype: torch.dtype) -> torch.Tensor:
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[1, ..., 4:] = False
    return keep if dtype is torch.bool else torch.where(keep, 0.0, -torch.inf).to(dtype)


def _ops(step: pe.TrainStep) -> list[str]:
    return [n.op for n in step.graph.nodes]


@pytest.mark.parametrize(
    ("sdpa", "mask", "kv_heads"),
    [
        ({}, None, 4),
        ({}, _padding(torch.bool), 4),
        ({}, _padding(torch.float64), 4),
        ({"is_causal": True, "scale": 0.3}, None, 4),
        ({"is_causal": True, "enable_gqa": True}, None, 2),
    ],
    ids=["plain", "bool-mask", "float-mask", "causal-scale", "gqa"],
)
@pytest.mark.parametrize("backend", ["numpy", "torch", "onnxruntime"])
def test_sdpa_is_one_op_with_torch_gradients(
    sdpa: dict[str, Any], mask: torch.Tensor | None, kv_heads: int, backend: str
) -> None:
    w = _workload(_Attend(kv_heads=kv_heads, **sdpa), mask)
    # onnxruntime fuses the scale into its MatMul as a float32 alpha: 1e-6 in float64
    tol = (
        {"rtol": 1e-6, "atol": 1e-9} if backend == "onnxruntime" else {"rtol": 1e-9, "atol": 1e-12}
    )
    step = assert_gradients_match(w, backend=backend, **tol)
    ops = _ops(step)
    assert ops.count("attention") == 1 and ops.count("attention_grad") == 1
    assert "softmax" not in ops and "safe_softmax" not in ops  # no [B, H, L, S] probabilities


def test_sdpa_with_dropout_takes_the_explicit_path() -> None:
    model = _Attend(dropout_p=0.5)
    w = _workload(model, None)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0))
    ops = _ops(step)
    assert "attention" not in ops and "safe_softmax" in ops and "random_mask" in ops
    batch = w.make_batch(0)
    assert step(*batch) != step(*batch)  # a fresh dropout mask each step


def test_sparse_schemes_prune_the_attention_backward() -> None:
    w = _workload(_Attend(), None)
    batch = w.make_batch(0)
    head = pe.compile(w.model, w.loss_fn, batch, scheme=pe.schemes.select(["out.*"]))
    assert "attention" in _ops(head) and "attention_grad" not in _ops(head)
    query = pe.compile(w.model, w.loss_fn, batch, scheme=pe.schemes.select(["q.*"]))
    assert "attention_grad" in _ops(query)
    got = query.gradients(*batch)
    _, ref = torch_gradients(w, batch)
    assert set(got) == {"q.weight", "q.bias"}
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-9, atol=1e-12, err_msg=name)


def _vjp_through_kernel(
    inputs: tuple[np.ndarray[Any, Any], ...], gout: np.ndarray[Any, Any]
) -> list[Any]:
    b = GraphBuilder("vjp")
    xs = [b.input(f"x{i}", TensorType(a.shape, DType.F64)) for i, a in enumerate(inputs)]
    out, _ = b.call_multi("attention", *xs, scale=0.4, causal=False)
    g = b.input("g", out.type)
    needs = (True, True, True) + (False,) * (len(inputs) - 3)
    ctx = VJPContext(b, b.nodes[-1], (g, None), needs)
    grads = get_op("attention").vjp(ctx)  # type: ignore[misc]
    assert [n.op for n in b.nodes[1:]] == ["attention_grad"]
    graph = b.build([v for v in grads if v is not None])
    feeds = {f"x{i}": a for i, a in enumerate(inputs)}
    return list(evaluate(graph, {**feeds, "g": gout}))


def test_attention_grad_kernel_matches_torch_autograd() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    mask = np.zeros((2, 1, 1, 5))
    mask[1, ..., 2:] = -np.inf
    gout = rng.standard_normal((2, 3, 5, 4))
    got = _vjp_through_kernel((q, k, v, mask), gout)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(mask), scale=0.4)
    out.backward(torch.tensor(gout))
    for ours, ref in zip(got, (tq.grad, tk.grad, tv.grad), strict=True):
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", [zoo.bert_classifier, zoo.llama_lm], ids=["bert", "llama"])
def test_transformers_attend_with_one_op_per_layer(make: Any) -> None:
    w = zoo.as_double(make())
    # atol: HF's LLaMA computes its rotary tables in float32 even in a float64 model
    step = assert_gradients_match(w, rtol=1e-6, atol=1e-7, backend="torch")
    model: Any = w.model
    config = model.config if hasattr(model, "config") else model.encoder.config
    assert _ops(step).count("attention") == config.num_hidden_layers > 0


class _ScaledQuery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q * self.w, k, v)


def test_torch_attention_kernel_on_channels_last_inputs() -> None:
    """ATen's CPU flash kernels assume unit stride on the last axis; the torch backend
    stores 4-D batch tensors channels-last, which must not reach them as they are."""
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)

    def loss(m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return m(q, k, v).square().sum()

    batch = (q, q.flip(2).clone(), q.flip(3).clone())
    w = zoo.Workload("q", _ScaledQuery(), loss, lambda seed: batch)
    step = assert_gradients_match(w, rtol=1e-10, atol=1e-12, backend="torch")
    assert "attention_grad" in _ops(step)
