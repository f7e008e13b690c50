"""The torch backend against the NumPy backend: every op, whole models, in-place state.

- every registered op's samples, as one-node graphs, in float64 to 1e-10 (effectful ops:
  the values they write);
- zoo models: the same gradients, then the same losses, params, buffers and optimizer
  state over five steps of SGD with momentum or AdamW (see ``_adamw`` and ``_mobilenet``
  for the two settings that keep the comparison well conditioned);
- the generated source: one line per node, no loop; views of a param stay the old value
  across its in-place update; errors name the node.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch.backend import KERNELS, TorchBackend, TorchKernelError
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


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def _cases() -> list[Any]:
    cases = []
    for name, opdef in sorted(all_ops().items()):
        samples = opdef.samples(np.random.default_rng(0)) if opdef.samples else []
        cases += [pytest.param(opdef, s, id=f"{name}-{i}") for i, s in enumerate(samples)]
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
    _check_op(opdef, sample, TorchBackend())


@pytest.mark.cuda
def test_ops_match_numpy_on_cuda() -> None:
    """Runs with ``pytest -m cuda`` on a machine with a GPU (not in the default run)."""
    backend = get_backend("torch-cuda")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cuda"
    for case in _cases():
        _check_op(*case.values, backend)


def _check_op(opdef: OpDef, sample: Sample, backend: TorchBackend, rtol: float = 1e-10) -> None:
    graph = _one_node(opdef, sample)
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
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol, err_msg=opdef.name)


@pytest.mark.parametrize("op", ["relu_grad", "gelu_grad", "hardtanh_grad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_kernels_broadcast(op: str, dtype: type) -> None:
    rng = np.random.default_rng(0)
    gz, x = rng.standard_normal((3, 4)).astype(dtype), rng.standard_normal(4).astype(dtype)
    attrs: dict[str, object] = {
        "gelu_grad": {"approximate": "tanh"},
        "hardtanh_grad": {"min_val": -0.5, "max_val": 0.5},
    }.get(op, {})
    for inputs in ((gz, x), (x, gz)):
        _check_op(all_ops()[op], Sample(inputs, attrs), TorchBackend(), rtol=1e-6)


# -- whole models ----------------------------------------------------------------------------
def _sgd(lr: float) -> pe.optim.Optimizer:
    return pe.optim.SGD(lr=lr, momentum=0.9, weight_decay=1e-3, nesterov=True)


def _adamw(lr: float) -> pe.optim.Optimizer:
    # AdamW divides each gradient element by its own magnitude, so a param whose true
    # gradient is zero (a key bias before softmax, a conv bias before BatchNorm) would move
    # by +-lr on float32 rounding noise alone; eps=1e-5 keeps that noise from being amplified.
    return pe.optim.AdamW(lr=lr, weight_decay=0.01, eps=1e-5)


def _mobilenet() -> zoo.Workload:
    # Randomly initialised, this network is ill-conditioned in float32 (see test_models), and
    # at batch 2 and 32x32 its last BatchNorms normalise two values each, amplifying rounding
    # differences about a millionfold per layer even in float64: batch 4 at 64x64, float64.
    return zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64))


_STEPS = 5
_Case = tuple[Callable[[], zoo.Workload], Callable[[], pe.optim.Optimizer]]
_CASES: dict[str, _Case] = {
    "mlp-sgd_momentum": (zoo.mlp, lambda: _sgd(0.05)),
    "small_cnn-sgd_momentum": (zoo.small_cnn, lambda: _sgd(0.05)),
    "small_cnn_dropout-sgd_momentum": (lambda: zoo.small_cnn(dropout=0.5), lambda: _sgd(0.05)),
    "bert-adamw": (zoo.bert_classifier, lambda: _adamw(1e-3)),
    "llama-adamw": (zoo.llama_lm, lambda: _adamw(1e-3)),
    "mobilenet_v2-adamw": (_mobilenet, lambda: _adamw(1e-4)),
}
# The other pairs: pytest -m slow.
_SLOW: dict[str, _Case] = {
    "mlp-adamw": (zoo.mlp, lambda: _adamw(1e-3)),
    "small_cnn-adamw": (zoo.small_cnn, lambda: _adamw(1e-3)),
    "small_cnn_dropout-adamw": (lambda: zoo.small_cnn(dropout=0.5), lambda: _adamw(1e-3)),
    "bert-sgd_momentum": (zoo.bert_classifier, lambda: _sgd(0.05)),
    "llama-sgd_momentum": (zoo.llama_lm, lambda: _sgd(0.05)),
    "mobilenet_v2-sgd_momentum": (_mobilenet, lambda: _sgd(1e-3)),
}
_PARAMS = [pytest.param(*case, id=name) for name, case in _CASES.items()] + [
    pytest.param(*case, id=name, marks=pytest.mark.slow) for name, case in _SLOW.items()
]


def _close(got: dict[str, Array], want: dict[str, Array], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{what} {name}")


@pytest.mark.parametrize(("workload", "optimizer"), _PARAMS)
def test_training_matches_numpy(
    workload: Callable[[], zoo.Workload], optimizer: Callable[[], pe.optim.Optimizer]
) -> None:
    """Gradients at the initial weights, then five steps: losses, params, buffers, state."""
    w = workload()
    batch = w.make_batch(0)
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=optimizer(), backend="numpy")
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=optimizer(), backend="torch")
    _close(ours.gradients(*batch), ref.gradients(*batch), "gradient")
    for i in range(_STEPS):
        batch = w.make_batch(i)
        want, got = ref(*batch), ours(*batch)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (i, got, want)
    _close(ours.state_dict(), ref.state_dict(), "state")
    _close(ours.optimizer_state(), ref.optimizer_state(), "optimizer state")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["full", "sparse"])
@pytest.mark.parametrize("workload", ["mbv2", "bert", "llama"])
def test_benchmark_workloads_match_numpy(workload: str, scheme: str) -> None:
    """The benchmark's own workloads (full size, their optimizers): the losses of five steps
    agree with the NumPy oracle to 1e-4. MobileNetV2 runs in float64: randomly initialised, its
    float32 gradients already differ by 14% between the two backends (and between two runs of
    the same one) in the last blocks, whose batch norms normalise 4x4x8 values (``_mobilenet``)."""
    losses = []
    for backend in ("numpy", "torch"):
        w, optimizer = zoo.benchmark(workload)
        if workload == "mbv2":
            w = zoo.as_double(w)
        step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer,
                          zoo.benchmark_schemes(workload)[scheme], backend=backend)  # fmt: skip
        losses.append([step(*w.make_batch(i)) for i in range(_STEPS)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


# -- state lives in the store, updated in place ----------------------------------------------
def test_params_are_updated_in_place_and_stay_usable() -> None:
    w = zoo.small_cnn()
    sgd = pe.optim.SGD(lr=0.1, momentum=0.9)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=sgd, backend="torch")
    step(*w.make_batch(0))  # the zeros it was given are copied once, before the first step
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


def test_a_non_contiguous_stored_tensor_is_refused() -> None:
    graph = _view_read_after_update()
    backend = TorchBackend()
    store = {"w": backend.from_numpy(np.ones((3, 2))).t(), "lr": backend.from_numpy(np.ones(()))}
    with pytest.raises(TorchKernelError, match=r"must be dense .*: \['w'\]"):
        backend.compile(graph).run(store, {"g": backend.from_numpy(np.ones((2, 3)))})


def test_the_dense_check_is_made_once_per_tensor() -> None:
    """A tensor found dense is remembered (weakly, by identity); one that is not is asked
    again each time, and a new tensor at a freed one's address is asked afresh."""
    from pockengine.backends.torch import stored

    dense, strided = torch.ones(3, 2), torch.ones(2, 3).t()
    assert stored.is_dense(dense) and stored._DENSE.get(id(dense)) is dense
    assert not stored.is_dense(strided) and not stored.is_dense(strided)
    assert id(strided) not in stored._DENSE
    key = id(dense)
    del dense  # its entry goes with it
    assert key not in stored._DENSE
    assert not stored.is_dense(torch.ones(4, 4).t())


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
    # paired kernels: max pooling keeps its argmax for the backward, batch norm its 1/std,
    # a convolution's input and weight gradients come from one call
    assert "(True, True, False))" in exe.source
    assert re.search(r"v\d+, (h\d+) = aten_max_pool2d_with_indices\(", exe.source)
    assert re.search(r"aten_max_pool2d_with_indices_backward\(.*, h\d+\)", exe.source)
    assert re.search(r"aten_native_batch_norm_backward[(,].*, h\d+, True", exe.source)
    # every value a line makes is deleted on exactly one line, except the returned ones (an
    # early del would fail as a NameError in the model tests): memory follows liveness
    targets = [t for line in body for t in re.findall(r"(?:^|; )\s*([\w, ]+?) = ", line)]
    defined = {n for t in targets for n in t.split(", ") if n != "_"}
    deleted = [n for line in body for d in re.findall(r"del ([^;]+)$", line) for n in d.split(", ")]
    returned = set(re.findall(r"v\d+", code[-1]))
    assert sorted(deleted) == sorted(set(deleted))
    assert set(deleted) == defined - returned


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


# -- layout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("channels_last", [True, False])
def test_stored_layout_and_partial_channel_updates(channels_last: bool) -> None:
    """4-D params, optimizer state and images are stored channels-last (unless turned off);
    full, partial-channel (rows=k) and momentum updates on them match the NumPy backend."""
    w = zoo.small_cnn()
    batch = w.make_batch(0)
    channels = {"stem.weight": 0.5, "dw.weight": 0.25, "pw.weight": 0.5}
    scheme = pe.schemes.select(["*bias", "fc.*"], channels=channels)
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd(0.05), scheme=scheme)
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd(0.05), scheme=scheme,
                      backend="torch")  # fmt: skip
    ours.backend = TorchBackend(channels_last=channels_last)
    ours._store = {k: ours.backend.from_numpy(v.numpy()) for k, v in ours._store.items()}
    layout = torch.channels_last if channels_last else torch.contiguous_format
    four_d = [t for t in ours._store.values() if t.dim() == 4]
    assert four_d and all(t.is_contiguous(memory_format=layout) for t in four_d)
    assert any(not t.is_contiguous() for t in four_d) == channels_last
    for i in range(3):
        batch = w.make_batch(i)
        assert ours(*batch) == pytest.approx(ref(*batch), rel=1e-4, abs=1e-5)
    _close(ours.state_dict(), ref.state_dict(), "state")
    _close(ours.optimizer_state(), ref.optimizer_state(), "optimizer state")


def test_keeping_the_freed_heap_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes.util

    from pockengine.backends.torch import backend as torch_backend

    w = zoo.mlp()
    graph = pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="numpy").graph
    calls: list[int] = []
    monkeypatch.setattr(torch_backend, "keep_freed_heap", lambda: calls.append(1) or True)
    TorchBackend().compile(graph)  # the default keeps only the step's heap (backends.torch.heap)
    pe.compile(w.model, w.loss_fn, w.make_batch(0), backend="torch")
    assert calls == []
    TorchBackend(keep_heap=True).compile(graph)
    assert calls == [1]
    monkeypatch.undo()
    if ctypes.util.find_library("c") and platform.libc_ver()[0] == "glibc":
        assert torch_backend.keep_freed_heap() is True  # mallopt took both settings


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_frozen_weights_are_shared_with_the_model_and_trained_ones_copied(backend: str) -> None:
    """Compiling holds no second copy of what the step only reads: a frozen weight is the
    model's own memory (read-only); a trained weight is the step's copy, so training
    never writes the user's model, and the step's results equal a fully copied step's."""
    w = zoo.small_cnn()
    batch = w.make_batch(0)
    before = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
    scheme = pe.schemes.select(train=["fc.*"])
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme, backend=backend)
    store = step._store  # the backend's values, by IR name

    def address(value: Any) -> int:
        return int(value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data)

    params = dict(w.model.named_parameters())
    shared = {n for n, p in params.items() if n in store and address(store[n]) == p.data_ptr()}
    frozen = {n for n, p in params.items() if not n.startswith("fc.")}
    assert frozen and frozen <= shared  # 4-D conv weights too, in the layout they arrive in
    assert not any(n.startswith("fc.") for n in shared)
    if backend == "numpy":
        assert all(not store[n].flags.writeable for n in shared)
    copied = pe.compile(zoo.small_cnn().model, w.loss_fn, batch, scheme=scheme, backend=backend)
    for i in range(3):
        assert step(*w.make_batch(i)) == pytest.approx(copied(*w.make_batch(i)), rel=1e-6)
    for name, value in w.model.state_dict().items():  # the user's model is untouched
        assert torch.equal(value, before[name]), name
