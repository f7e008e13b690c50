"""The onnxruntime backend against the NumPy backend: every op, whole models, state carry.

- every registered op's samples as one-node graphs, in float32 (ONNX Runtime has no
  float64 Conv) to 2e-5; the dropout mask bit for bit;
- zoo models: the same losses, params and optimizer state over five steps, under full
  backprop and a sparse scheme, to 1e-4;
- params and optimizer state stay OrtValues carried from step to step: two buffers per
  written value, swapped, never reallocated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import pockengine as pe
from pockengine.backends import get_backend
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.onnx.backend import OrtBackend
from pockengine.backends.onnx.emit import kernel_table
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
from tests.test_op_facts import KNOWN_ABSENT

Array = np.ndarray[Any, Any]


def _f32(a: Array) -> Array:
    return a.astype(np.float32) if a.dtype == np.float64 else a


def _cases() -> list[Any]:
    cases = []
    for name, opdef in sorted(all_ops().items()):
        if name in KNOWN_ABSENT["onnxruntime"]:
            continue  # test_op_facts checks the list; test_known_absent_ops_are_refused
        samples = opdef.samples(np.random.default_rng(0)) if opdef.samples else []
        for i, sample in enumerate(samples):
            cases.append(pytest.param(opdef, sample, id=f"{name}-{i}"))
    return cases


def _one_node(opdef: OpDef, inputs: list[Array], attrs: dict[str, Any]) -> Graph:
    b = GraphBuilder(opdef.name)
    xs = [
        b.input(
            f"x{i}",
            TensorType(a.shape, DType.from_numpy(a.dtype)),
            Role.STATE if i in opdef.mutates else Role.INPUT,
        )
        for i, a in enumerate(inputs)
    ]
    return b.build(b.call_multi(opdef.name, *xs, source="test", **attrs))


def test_every_op_has_an_onnx_kernel() -> None:
    assert sorted(set(all_ops()) - set(kernel_table())) == sorted(KNOWN_ABSENT["onnxruntime"])


@pytest.mark.parametrize("op", sorted(KNOWN_ABSENT["onnxruntime"]))
def test_known_absent_ops_are_refused(op: str, ort_backend: OrtBackend) -> None:
    """A graph with an op the backend lacks is an UnsupportedOpError naming it."""
    opdef = all_ops()[op]
    assert opdef.samples is not None
    sample = opdef.samples(np.random.default_rng(0))[0]
    graph = _one_node(opdef, [_f32(a) for a in sample.inputs], sample.attrs)
    assert not ort_backend.claims(graph.nodes[0])
    with pytest.raises(UnsupportedOpError, match=op):
        ort_backend.compile(graph)


@pytest.fixture(scope="module")
def ort_backend() -> OrtBackend:
    return OrtBackend(device="cpu", threads=1)


@pytest.mark.parametrize(("opdef", "sample"), _cases())
def test_op_matches_numpy(opdef: OpDef, sample: Sample, ort_backend: OrtBackend) -> None:
    inputs = [_f32(a) for a in sample.inputs]
    graph = _one_node(opdef, inputs, sample.attrs)
    store_np = {f"x{i}": a.copy() for i, a in enumerate(inputs)}
    store_ort = {k: ort_backend.from_numpy(a) for k, a in store_np.items()}
    want = NumpyBackend().compile(graph).run(store_np)
    got = ort_backend.compile(graph).run(store_ort)
    for i in opdef.mutates:  # effects: the written values
        want.append(store_np[f"x{i}"])
        got.append(store_ort[f"x{i}"])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = ort_backend.to_numpy(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        tol = 0 if opdef.name == "random_mask" else 2e-5
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=opdef.name)


def test_random_mask_is_bit_exact_for_any_seed(ort_backend: OrtBackend) -> None:
    opdef = all_ops()["random_mask"]
    for seed in (0, 1, -7, 2**40 + 3, -(2**62)):
        s = np.asarray(seed, dtype=np.int64)
        attrs = {"shape": (5, 33), "p": 0.3, "salt": 12345}
        graph = _one_node(opdef, [s], attrs)
        want = NumpyBackend().compile(graph).run({"x0": s})[0]
        got = ort_backend.to_numpy(ort_backend.compile(graph).run({"x0": s})[0])
        np.testing.assert_array_equal(got, want)


# -- whole models ----------------------------------------------------------------------------


def _sgd() -> pe.optim.Optimizer:
    return pe.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


def _adamw() -> pe.optim.Optimizer:
    # eps=1e-5: a param whose true gradient is zero would move by +-lr on rounding noise
    return pe.optim.AdamW(lr=1e-3, weight_decay=0.01, eps=1e-5)


def _assert_backends_agree(
    work: Any, optimizer: Callable[[], pe.optim.Optimizer], scheme: Any, steps: int = 5
) -> pe.TrainStep:
    batch = work.make_batch(0)
    ref = pe.compile(work.model, work.loss_fn, batch, optimizer=optimizer(), scheme=scheme)
    got = pe.compile(
        work.model,
        work.loss_fn,
        batch,
        optimizer=optimizer(),
        scheme=scheme,
        backend="onnxruntime-cpu",
    )
    for i in range(steps):
        b = work.make_batch(i)
        want, loss = ref(*b), got(*b)
        assert abs(loss - want) <= 1e-4 * max(1.0, abs(want)), (i, loss, want)
    for mine, theirs in (
        (got.state_dict(), ref.state_dict()),
        (got.optimizer_state(), ref.optimizer_state()),
    ):
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            np.testing.assert_allclose(mine[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    return got


def _zoo(name: str) -> Any:
    from pockengine import zoo

    if name == "mbv2":
        # At batch 2 and 32x32, training-mode BatchNorm makes this randomly initialised net
        # ill-conditioned in float32 for every backend (torch's own f32 and f64 losses differ
        # by 1e-3) and ONNX Runtime has no float64 Conv: its BatchNorms use running statistics.
        work = zoo.mobilenet_v2(width=0.35, batch=2, size=32)
        work.model.eval()
        return work
    return {
        "mlp": zoo.mlp,
        "cnn": zoo.small_cnn,
        "bert": zoo.bert_classifier,
        "llama": zoo.llama_lm,
        "cnn-dropout": lambda: zoo.small_cnn(dropout=0.5),
    }[name]()


def _scheme(name: str) -> Any:
    return {
        "full": pe.schemes.full(),
        "sparse": pe.schemes.sparse(blocks=1),
        "bias": pe.schemes.bias_only(),
    }[name]


_FAST = [
    ("mlp", "full", _sgd),
    ("mlp", "bias", _sgd),
    ("cnn", "full", _sgd),
    ("cnn", "bias", _sgd),
    ("cnn-dropout", "full", _sgd),
]
_SLOW = [
    ("mbv2", "full", _adamw),
    ("mbv2", "sparse", _adamw),
    ("bert", "full", _adamw),
    ("bert", "sparse", _adamw),
    ("llama", "full", _adamw),
    ("llama", "sparse", _adamw),
]


@pytest.mark.parametrize(
    ("model", "scheme", "optimizer"), _FAST, ids=[f"{m}-{s}" for m, s, _ in _FAST]
)
def test_model_matches_numpy(model: str, scheme: str, optimizer: Any) -> None:
    _assert_backends_agree(_zoo(model), optimizer, _scheme(scheme))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "scheme", "optimizer"), _SLOW, ids=[f"{m}-{s}" for m, s, _ in _SLOW]
)
def test_large_model_matches_numpy(model: str, scheme: str, optimizer: Any) -> None:
    _assert_backends_agree(_zoo(model), optimizer, _scheme(scheme))


def test_state_is_carried_in_two_swapped_buffers() -> None:
    from pockengine import zoo

    work = zoo.mlp()
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, optimizer=_sgd(), backend="onnxruntime")
    store = step._store
    name = "0.weight"
    seen = []
    for _ in range(4):
        seen.append(store[name])
        step(*batch)
    assert type(store[name]).__name__ == "OrtValue"
    assert seen[0] is seen[2] and seen[1] is seen[3] and seen[0] is not seen[1]
    assert seen[0].data_ptr() != seen[1].data_ptr()


def test_backend_names_route_to_onnxruntime() -> None:
    backend = get_backend("onnxruntime-cpu")
    assert isinstance(backend, OrtBackend) and backend.device == "cpu"
    assert isinstance(get_backend("onnxruntime"), OrtBackend)
    with pytest.raises(pe.CompileError):
        OrtBackend(device="tpu")


def test_gradients_and_load_state_on_onnxruntime() -> None:
    from pockengine import zoo

    work = zoo.small_cnn()
    batch = work.make_batch(0)
    ref = pe.compile(work.model, work.loss_fn, batch)
    got = pe.compile(work.model, work.loss_fn, batch, backend="onnxruntime-cpu")
    want = ref.gradients(*batch)
    for name, g in got.gradients(*batch).items():
        np.testing.assert_allclose(g, want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    ref(*batch)
    got.load_state(ref.state_dict(), ref.optimizer_state())
    assert got(*batch) == pytest.approx(ref(*batch), rel=1e-5)
