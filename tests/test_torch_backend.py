"""The torch backend against the NumPy backend: every op, whole models, in-place state.

- every registered op's samples, as one-node graphs, in float64 to 1e-10 (effectful ops:
  the values they write);
- zoo models: the same losses, state and gradients over five steps of SGD with momentum
  or AdamW (MobileNetV2 at batch 2 is ill-conditioned in float32 and runs in float64);
- the generated source: one line per node, no loop; views of a param stay the old value
  across its in-place update; errors name the node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.numpy_backend import NumpyBackend
from pockengine.backends.torch_backend import KERNELS, TorchBackend, TorchKernelError
from pockengine.ir import (
    DType,
    Graph,
    GraphBuilder,
    OpDef,
    Role,
    Sample,
    TensorType,
    UnsupportedOpError,
    all_ops,
)

Array = np.ndarray[Any, Any]


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def _cases() -> list[Any]:
    cases = []
    for name, opdef in sorted(all_ops().items()):
        for i, sample in enumerate(opdef.samples(np.random.default_rng(0)) if opdef.samples else []):
            cases.append(pytest.param(opdef, sample, id=f"{name}-{i}"))
    return cases


def _one_node(opdef: OpDef, sample: Sample) -> Graph:
    """inputs x0, x1, ...; the ones the op writes are state."""
    b = GraphBuilder(opdef.name)
    xs = [
        b.input(f"x{i}", _type_of(a), Role.STATE if i in opdef.mutates else Role.INPUT)
        for i, a in enumerate(sample.inputs)
    ]
    outs = b.call_multi(opdef.name, *xs, source="test", **sample.attrs)
    return b.build(outs)


def test_every_op_has_a_torch_kernel() -> None:
    assert sorted(set(all_ops()) - set(KERNELS)) == []


@pytest.mark.parametrize(("opdef", "sample"), _cases())
def test_op_matches_numpy(opdef: OpDef, sample: Sample) -> None:
    graph = _one_node(opdef, sample)
    backend = TorchBackend()
    store_np = {f"x{i}": a.copy() for i, a in enumerate(sample.inputs)}
    store_t = {k: backend.from_numpy(a) for k, a in store_np.items()}
    written = {f"x{i}": store_t[f"x{i}"] for i in opdef.mutates}
    want = NumpyBackend().compile(graph).run(store_np)
    got = backend.compile(graph).run(store_t)
    for name, tensor in written.items():  # written in place
        assert store_t[name] is tensor
        got.append(tensor)
        want.append(store_np[name])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = backend.to_numpy(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


# -- whole models ----------------------------------------------------------------------------
def _mobilenet() -> zoo.Workload:
    return zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=2, size=32))


_MODELS: dict[str, Callable[[], zoo.Workload]] = {
    "mlp": zoo.mlp,
    "small_cnn": zoo.small_cnn,
    "mobilenet_v2": _mobilenet,
    "bert": zoo.bert_classifier,
    "llama": zoo.llama_lm,
    "small_cnn_dropout": lambda: zoo.small_cnn(dropout=0.5),
}
_OPTIMIZERS: dict[str, Callable[[], pe.optim.Optimizer]] = {
    "sgd_momentum": lambda: pe.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adamw": lambda: pe.optim.AdamW(lr=1e-3, weight_decay=0.01),
}
# Each model once and each optimizer several times by default; all pairs with -m slow.
_DEFAULT = {
    ("mlp", "sgd_momentum"),
    ("mlp", "adamw"),
    ("small_cnn", "sgd_momentum"),
    ("mobilenet_v2", "sgd_momentum"),
    ("bert", "adamw"),
    ("llama", "adamw"),
    ("small_cnn_dropout", "adamw"),
}
_PAIRS = [
    pytest.param(m, o, id=f"{m}-{o}", marks=() if (m, o) in _DEFAULT else pytest.mark.slow)
    for m in _MODELS
    for o in _OPTIMIZERS
]


def _close(got: dict[str, Array], want: dict[str, Array], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{what} {name}")


@pytest.mark.parametrize(("model", "optimizer"), _PAIRS)
def test_training_matches_numpy(model: str, optimizer: str) -> None:
    w = _MODELS[model]()
    steps = {
        backend: pe.compile(
            w.model, w.loss_fn, w.make_batch(0), optimizer=_OPTIMIZERS[optimizer](), backend=backend
        )
        for backend in ("numpy", "torch")
    }
    for i in range(5):
        batch = w.make_batch(i)
        want, got = steps["numpy"](*batch), steps["torch"](*batch)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (i, got, want)
    ref, ours = steps["numpy"], steps["torch"]
    _close(ours.state_dict(), ref.state_dict(), "state")
    _close(ours.optimizer_state(), ref.optimizer_state(), "optimizer state")
    batch = w.make_batch(5)
    _close(ours.gradients(*batch), ref.gradients(*batch), "gradient")


# -- state lives in the store, updated in place ----------------------------------------------
def test_params_are_updated_in_place_and_stay_usable() -> None:
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.1, momentum=0.9), backend="torch")  # fmt: skip
    before = {k: (t, t.data_ptr()) for k, t in step._store.items()}
    before_values = step.state_dict()
    for i in range(2):
        step(*w.make_batch(i))
    for k, (tensor, ptr) in before.items():
        assert step._store[k] is tensor and tensor.data_ptr() == ptr, k
    assert any(not np.array_equal(v, before_values[k]) for k, v in step.state_dict().items())
    # Written in inference mode, yet normal tensors: autograd and in-place ops work outside.
    weight = step._store["fc.weight"]
    assert not weight.is_inference()
    scale = torch.ones_like(weight, requires_grad=True)
    (weight * scale).sum().backward()
    assert scale.grad is not None and torch.equal(scale.grad, weight)
    weight.add_(0.0)
    step(*w.make_batch(2))
    step.load_into(w.model)


def test_from_numpy_copies_and_keeps_dtype() -> None:
    backend = TorchBackend()
    for array in (np.arange(6, dtype=np.int32), np.ones((2, 3)), np.zeros(3, dtype=bool)):
        tensor = backend.from_numpy(array)
        array[...] = 7
        assert backend.to_numpy(tensor).dtype == array.dtype
        assert not np.array_equal(backend.to_numpy(tensor), array)
    assert get_backend("torch").name == "torch"


def _view_read_after_update() -> Graph:
    b = GraphBuilder("g")
    f64 = TensorType((2, 3), DType.F64)
    w = b.input("w", f64, Role.PARAM, trainable=True)
    g = b.input("g", f64)
    lr = b.input("lr", TensorType((), DType.F64), Role.STATE)
    wt = b.call("transpose", w, perm=(1, 0))
    b.effect("sgd_update", w, g, lr, weight_decay=0.0)
    return b.build([b.call("mul", wt, b.scalar(2.0, DType.F64)), wt])


def test_views_of_a_param_keep_the_value_before_its_update() -> None:
    graph = _view_read_after_update()
    w, g = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    lr = np.asarray(0.5)
    backend = TorchBackend()
    store = {"w": backend.from_numpy(w), "lr": backend.from_numpy(lr)}
    doubled, view = backend.compile(graph).run(store, {"g": backend.from_numpy(g)})
    np.testing.assert_array_equal(backend.to_numpy(doubled), 2 * w.T)
    np.testing.assert_array_equal(backend.to_numpy(view), w.T)
    np.testing.assert_array_equal(backend.to_numpy(store["w"]), w - 0.5)
    store["w"].zero_()  # a returned value never shares memory with the store
    np.testing.assert_array_equal(backend.to_numpy(view), w.T)


# -- the generated source --------------------------------------------------------------------
def test_source_is_one_straight_line_per_node() -> None:
    w = zoo.small_cnn(dropout=0.5)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="torch")
    exe = step._exec
    code = [line.split("  # ", 1)[0] for line in exe.source.splitlines()]
    assert code[0].startswith("def ") and code[-1].lstrip().startswith("return ")
    body = code[1:-1]
    assert len(body) == len(exe.graph.nodes)
    assert not any("for " in line or "while " in line for line in code)
    assert "aten_conv2d(" in exe.source and "random_mask(" in exe.source
    assert any(line.strip().startswith("v") and "del " in line for line in body)


def test_an_op_without_a_kernel_is_a_compile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(KERNELS, "relu_grad")
    monkeypatch.delitem(KERNELS, "relu")
    w = zoo.mlp()
    with pytest.raises(UnsupportedOpError) as info:
        pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="torch")
    assert "relu  at " in str(info.value) and "relu_grad  at grad" in str(info.value)


def test_a_failing_kernel_names_its_node() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2, 3), DType.F64))
    i = b.input("i", TensorType((2, 1), DType.I64))
    graph = b.build([b.call("gather", x, i, axis=1, source="my.module")])
    backend = TorchBackend()
    feeds = {"x": backend.from_numpy(np.ones((2, 3))), "i": backend.from_numpy(np.full((2, 1), 5))}
    with pytest.raises(TorchKernelError, match=r"gather\(x, i, axis=1\)  # my.module"):
        backend.compile(graph).run({}, feeds)
