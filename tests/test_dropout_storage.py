"""Dropout's storage: what the backward keeps of a dropout is a 1-byte keep-mask.

Dropout lowers to ``where(ne(random_mask, 0), x * f(1/(1-p)), 0)`` (``frontend.rng``), so
- no float32 ``random_mask`` value is read by the backward pass: it dies in the forward,
  and every dropout value the backward reads is a bool (or recomputed there);
- gradients equal torch.autograd on the same model with the same mask applied by hand;
- every backend trains it as the NumPy reference does (float32 tolerance).
The torch, ONNX and Keras (slow: TensorFlow) frontends are each checked.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.ir import DType, Graph, Node, Phase, get_op

P = 0.5


class _DropNet(nn.Module):
    """tanh(fc1(x)) -> dropout -> fc2; ``mask`` (when set) replaces the dropout by hand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 16), nn.Dropout(P), nn.Linear(16, 3)
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc2(self.drop(h) if self.mask is None else h * self.mask)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(rng.integers(0, 3, 8))


def _compile(model: nn.Module, backend: str = "numpy") -> pe.TrainStep:
    model.train()
    return pe.compile(model, _loss, _batch(), optimizer=pe.optim.SGD(lr=0.1), backend=backend)


def _backward_reads(graph: Graph) -> dict[str, list[Node]]:
    """Forward values read by backward nodes, with their readers."""
    made_in_forward = {
        o.name for n in graph.nodes if n.phase is not Phase.BACKWARD for o in n.outputs
    }
    reads: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.phase is Phase.BACKWARD:
            for v in n.inputs:
                if v.name in made_in_forward:
                    reads.setdefault(v.name, []).append(n)
    return reads


def _masks(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "random_mask" and n.phase is not Phase.BACKWARD]


def _mlp() -> tuple[nn.Module, Any, tuple[torch.Tensor, ...]]:
    return _DropNet(), _loss, _batch()


def _bert() -> tuple[nn.Module, Any, tuple[torch.Tensor, ...]]:
    w = zoo.bert_classifier(layers=1, hidden=16, heads=2, ffn=32, seq=8, batch=2, vocab=30,
                            dropout=0.1)  # fmt: skip
    return w.model, w.loss_fn, w.make_batch(0)


@pytest.mark.parametrize("make", [_mlp, _bert], ids=["mlp", "bert"])
def test_the_backward_keeps_a_bool_mask_never_the_float_one(make: Any) -> None:
    model, loss_fn, batch = make()
    model.train()
    step = pe.compile(model, loss_fn, batch, optimizer=pe.optim.SGD(lr=0.1))
    graph, reads = step.graph, _backward_reads(step.graph)
    masks = {m.outputs[0].name for m in _masks(graph)}
    assert masks and not masks & set(reads)  # every float mask dies in the forward
    keeps = [n.outputs[0] for n in graph.nodes if n.op == "ne" and n.inputs[0].name in masks]
    assert len(keeps) == len(masks)
    saved = [k for k in keeps if k.name in reads]
    assert saved and all(k.dtype is DType.BOOL for k in saved)
    assert {r.op for k in saved for r in reads[k.name]} == {"where"}


def _onnx_step(model: _DropNet, tmp_path: Path) -> pe.TrainStep:
    """``model`` exported by the TorchScript exporter in training mode (ONNX Dropout with
    training_mode true), compiled from the file."""
    path = tmp_path / "drop.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (_batch()[0],), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)  # fmt: skip
    return pe.compile(str(path), loss="cross_entropy", example_batch=_batch())


@pytest.mark.parametrize("frontend", ["torch", "onnx"])
def test_gradients_equal_torch_autograd_with_the_same_mask(frontend: str, tmp_path: Path) -> None:
    model = _DropNet()
    step = _compile(model) if frontend == "torch" else _onnx_step(model.train(), tmp_path)
    x, y = _batch()
    got = step.gradients(x, y)
    (mask_node,) = _masks(step.graph)
    kernel = get_op("random_mask").kernel
    mask = kernel(np.zeros((), np.int64), **dict(mask_node.attrs.items()))  # seed 0: step 1
    assert 0 < np.count_nonzero(mask) < mask.size  # some dropped, some kept
    assert mask_node.outputs[0].name not in _backward_reads(step.graph)
    model.mask = torch.from_numpy(mask)
    model.zero_grad()
    _loss(model, x, y).backward()
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None
        np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", ["torch", "c", "onnxruntime"])
def test_backends_train_dropout_as_the_numpy_reference(backend: str) -> None:
    ref, other = _compile(_DropNet()), _compile(_DropNet(), backend)
    for i in range(3):  # the mask changes every step: a wrong mask moves the loss
        batch = _batch(i)
        np.testing.assert_allclose(other(*batch), ref(*batch), rtol=1e-5, err_msg=str(i))
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(other.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)  # fmt: skip


@pytest.mark.slow  # importing TensorFlow takes ~20 s
def test_keras_dropout_keeps_the_bool_mask_too() -> None:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dropout(P), keras.layers.Dense(3)])  # fmt: skip
    x, y = (t.numpy() for t in _batch())
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y))
    (mask_node,) = _masks(step.graph)
    reads = _backward_reads(step.graph)
    assert mask_node.outputs[0].name not in reads
    (keep,) = [n.outputs[0] for n in step.graph.nodes
               if n.op == "ne" and n.inputs[0] is mask_node.outputs[0]]  # fmt: skip
    assert keep.name in reads and keep.dtype is DType.BOOL
