"""The ONNX frontend: zoo models exported with torch.onnx.export give torch.autograd's loss
and gradients; ModelInfo lets schemes pick the same params as on the torch module; every
unsupported op is listed at once.

What the exporters of torch 2.13 give (see docs/onnx.md): param names survive with
``dynamo=True, optimize=False`` or ``dynamo=False, do_constant_folding=False``. The dynamo
exporter writes every BatchNorm in inference form, so BatchNorm models are compared in eval
mode; the TorchScript exporter with ``training=TrainingMode.TRAINING`` keeps training-mode
BatchNorm (and Dropout).
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

import onnx  # noqa: E402
from onnx import helper  # noqa: E402

import pockengine as pe  # noqa: E402
from pockengine import zoo  # noqa: E402
from pockengine.frontend.onnx import load_onnx, onnx_model_info  # noqa: E402
from pockengine.frontend.torch import torch_model_info  # noqa: E402
from pockengine.sparse.schemes import resolve_scheme  # noqa: E402

_DYNAMO = pytest.mark.skipif(
    importlib.util.find_spec("onnxscript") is None,
    reason="torch.onnx.export(dynamo=True) needs onnxscript",
)


class _Logits(torch.nn.Module):
    """A Hugging Face causal LM returning only its logits (what an ONNX file holds)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.m = lm

    def forward(self, ids: Any) -> Any:
        return self.m(input_ids=ids, use_cache=False).logits


def export(module: Any, args: tuple[Any, ...], path: Path, exporter: str) -> Path:
    """torch.onnx.export with folding off, so that params keep their torch names."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, args, str(path), dynamo=True, optimize=False, verbose=False)
        else:
            mode = torch.onnx.TrainingMode.TRAINING if module.training else None
            mode = mode or torch.onnx.TrainingMode.EVAL
            torch.onnx.export(
                module, args, str(path), dynamo=False, training=mode, do_constant_folding=False
            )
    return path


def assert_matches_autograd(
    work: zoo.Workload, path: Path, loss: str, n_inputs: int, rtol: float = 1e-4, atol: float = 1e-5
) -> pe.TrainStep:
    batch = work.make_batch(0)
    step = pe.compile(str(path), loss=loss, example_batch=batch)
    model = copy.deepcopy(work.model)
    ref = work.loss_fn(model, *batch)
    ref.backward()
    want = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    got = step.gradients(*batch)
    assert set(got) == set(want), set(got) ^ set(want)
    for name, g in got.items():
        np.testing.assert_allclose(g, want[name], rtol=rtol, atol=atol, err_msg=name)
    loss_value, ref_value = step(*batch), float(ref.detach())
    assert abs(loss_value - ref_value) <= 1e-5 * max(1.0, abs(ref_value))
    return step


@_DYNAMO
def test_mlp_dynamo(tmp_path: Path) -> None:
    work = zoo.mlp()
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "mlp.onnx", "dynamo")
    assert_matches_autograd(work, path, "cross_entropy", 1)


def test_mlp_torchscript(tmp_path: Path) -> None:
    work = zoo.mlp()
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "mlp.onnx", "torchscript")
    step = assert_matches_autograd(work, path, "cross_entropy", 1)
    assert set(step.state_dict()) == set(work.model.state_dict())


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cnn_torchscript(tmp_path: Path, mode: str) -> None:
    """Training-mode BatchNorm (batch statistics, running statistics updated) or, in eval
    mode, BatchNorm on running statistics; eval export shares equal tensors through
    Identity nodes, which become separate params again."""
    work = zoo.small_cnn()
    work.model.train(mode == "train")
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "cnn.onnx", "torchscript")
    step = assert_matches_autograd(work, path, "cross_entropy", 1)
    assert set(step.state_dict()) == set(work.model.state_dict()) - {
        "bn1.num_batches_tracked",
        "bn2.num_batches_tracked",
    }
    if mode == "train":  # the running statistics moved (ONNX's rule: biased batch variance)
        assert not np.allclose(step.state_dict()["bn1.running_mean"], 0.0)


@pytest.mark.slow
@_DYNAMO
def test_cnn_dynamo_eval(tmp_path: Path) -> None:
    work = zoo.small_cnn()
    work.model.eval()
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "cnn.onnx", "dynamo")
    assert_matches_autograd(work, path, "cross_entropy", 1)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", [pytest.param("dynamo", marks=_DYNAMO), "torchscript"])
def test_bert(tmp_path: Path, exporter: str) -> None:
    work = zoo.bert_classifier()
    path = export(work.model, work.make_batch(0)[:2], tmp_path / "bert.onnx", exporter)
    assert_matches_autograd(work, path, "cross_entropy", 2)
    model = load_onnx(str(path))
    info = onnx_model_info(model)
    torch_info = torch_model_info(work.model)
    assert (info.blocks, info.head) == (torch_info.blocks, torch_info.head)
    for scheme in (pe.schemes.sparse(blocks=1), pe.schemes.bias_only(), pe.schemes.head()):
        assert resolve_scheme(scheme, info).rows == resolve_scheme(scheme, torch_info).rows


@pytest.mark.slow
@_DYNAMO
def test_llama(tmp_path: Path) -> None:
    work = zoo.llama_lm()
    lm = _Logits(work.model)
    path = export(lm, work.make_batch(0), tmp_path / "llama.onnx", "dynamo")
    wrapped = zoo.Workload("llama", lm, lambda m, ids: work.loss_fn(m.m, ids), work.make_batch)
    assert_matches_autograd(wrapped, path, "causal_lm", 1)
    info = onnx_model_info(load_onnx(str(path)))
    assert info.blocks == "m.model.layers" and info.head == "m.lm_head"
    norms = [p.name for p in info.params if p.is_norm]
    assert "m.model.norm.weight" in norms and len(norms) == 5


@pytest.mark.slow
@_DYNAMO
def test_mobilenet_v2_eval(tmp_path: Path) -> None:
    work = zoo.mobilenet_v2(width=0.35, batch=2, size=32)
    work.model.eval()
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "mbv2.onnx", "dynamo")
    assert_matches_autograd(work, path, "cross_entropy", 1)


@pytest.mark.slow
def test_mobilenet_v2_torchscript_train_f64(tmp_path: Path) -> None:
    """Training-mode BatchNorm through the TorchScript exporter; in float64, where this
    randomly initialised network is well enough conditioned to compare (see test_models)."""
    work = zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64))
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "mbv2.onnx", "torchscript")
    assert_matches_autograd(work, path, "cross_entropy", 1, rtol=1e-6, atol=1e-8)


def test_schemes_resolve_as_on_the_torch_module(tmp_path: Path) -> None:
    work = zoo.small_cnn()
    path = export(work.model, work.make_batch(0)[:1], tmp_path / "cnn.onnx", "torchscript")
    info, torch_info = onnx_model_info(load_onnx(str(path))), torch_model_info(work.model)
    assert [p.name for p in info.params] == [p.name for p in torch_info.params]
    assert info.head == torch_info.head == "fc"
    for scheme in (pe.schemes.bias_only(), pe.schemes.head(), pe.schemes.full()):
        assert resolve_scheme(scheme, info).rows == resolve_scheme(scheme, torch_info).rows
    step = pe.compile(
        str(path),
        loss="cross_entropy",
        example_batch=work.make_batch(0),
        scheme=pe.schemes.bias_only(frozen_bn="eval"),
    )
    assert set(step.trained) == {
        "dw.bias",
        "pw.bias",
        "fc.bias",
        "bn1.weight",
        "bn1.bias",
        "bn2.weight",
        "bn2.bias",
    }


# -- losses, outputs and errors --------------------------------------------------------------


def _tiny_model(nodes: list[Any], inits: list[Any], outputs: list[str], opset: int = 18) -> Any:
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _weight(name: str, shape: tuple[int, ...]) -> Any:
    rng = np.random.default_rng(0)
    return onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def test_unsupported_ops_are_listed_at_once() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Det", ["h"], ["e"], name="mix"),
        helper.make_node("NonZero", ["e"], ["nz"], name="where_nonzero"),
        helper.make_node("FusedGemm", ["h", "w2"], ["f"], name="fused", domain="com.microsoft"),
        # computed from constants only: folded, so not unsupported although unconverted
        helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="positions"),
    ]
    inits = [_weight("w", (3, 5)), _weight("w2", (5, 5))] + [
        onnx.numpy_helper.from_array(np.asarray(v, dtype=np.int64), n)
        for n, v in (("start", 0), ("limit", 4), ("delta", 1))
    ]
    with pytest.raises(pe.UnsupportedOpError) as info:
        pe.compile(_tiny_model(nodes, inits, ["f"]), loss="mse")
    assert info.value.entries == [
        ("Det", "mix"),
        ("NonZero", "where_nonzero"),
        ("com.microsoft::FusedGemm", "fused"),
    ]
    assert "3 unsupported ONNX ops" in str(info.value)


def test_named_output_and_losses() -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["logits"], name="fc", transB=1),
        helper.make_node("Relu", ["logits"], ["act"], name="relu"),
    ]
    model = _tiny_model(nodes, [_weight("w", (5, 3)), _weight("b", (5,))], ["logits", "act"])
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    y = np.asarray([0, 4, 2, 1])
    with pytest.raises(pe.CompileError, match="name one with output="):
        pe.compile(model, loss="cross_entropy", example_batch=(x, y))
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y), output="logits")
    logits = x @ onnx.numpy_helper.to_array(model.graph.initializer[0]).T
    logits = logits + onnx.numpy_helper.to_array(model.graph.initializer[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    lsm = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert step(x, y) == pytest.approx(-lsm[np.arange(4), y].mean(), rel=1e-5)
    mse = pe.compile(model, loss="mse", output=1)  # targets inferred: act's type
    assert [v.name for v in mse._batch] == ["x", "target"]
    with pytest.raises(pe.CompileError, match="needs a named loss"):
        pe.compile(model, output=0)


def test_pow_by_a_computed_exponent() -> None:
    """Pow(base, x @ w): the float ``pow`` op, its loss as NumPy computes it."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["e"], name="proj"),
        helper.make_node("Pow", ["base", "e"], ["out"], name="power"),
    ]
    base = onnx.numpy_helper.from_array(np.asarray([1.5, 0.5, 2.0], dtype=np.float32), "base")
    model = _tiny_model(nodes, [_weight("w", (3, 3)), base], ["out"])
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    target = np.zeros((4, 3), np.float32)
    step = pe.compile(model, loss="mse", example_batch=(x, target))
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    out = np.asarray([1.5, 0.5, 2.0], np.float32) ** (x @ w)
    assert "pow" in {n.op for n in step.forward.nodes}
    assert step(x, target) == pytest.approx(np.mean(out**2), rel=1e-5)
