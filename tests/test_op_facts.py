"""Op facts (``ir.Fact``) checked against what the backends' kernels actually do.

- every op whose torch kernel returns memory shared with an input (a view, or the input
  itself), on any of its sample inputs, is declared ``Fact.VIEW``: otherwise in-place
  reuse (``plan.inplace``) and the update reordering could write through that alias into
  a value still read, and nothing else would fail. A mutation (``transpose`` declared
  non-view) is caught by the same check;
- the ONNX Runtime backend never returns memory shared with its inputs (each step is one
  session whose outputs are fresh), so no fact of an op can be contradicted there;
- every ``Fact.INPLACE`` op is elementwise with one result and its torch kernel writes
  with ``out=``/``grad_input=`` when the plan lets it (the numbers, and every op's
  samples, are checked in ``test_inplace.py``);
- the facts are consistent (constants are creations, effects are exactly the ops that
  write inputs, views and in-place ops have one result);
- every op has a NumPy kernel (the registry requires it) and a kernel in every backend's
  table, or is listed below as knowingly absent: adding an elementwise op fails here until
  each backend has its kernel;
- every elementwise op has a converter in each frontend (torch, ONNX, JAX, Keras) or a
  reason it has none: adding one fails here until each frontend emits it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine.frontend
import pockengine.ops  # registers the ops
from pockengine.backends.c import CBackend
from pockengine.backends.onnx.backend import OrtBackend
from pockengine.backends.torch.backend import _FINDERS, KERNELS, TorchBackend
from pockengine.backends.torch.codegen import generate_source
from pockengine.ir import (
    DType,
    Fact,
    Graph,
    GraphBuilder,
    OpDef,
    Role,
    Sample,
    TensorType,
    all_ops,
    registry,
)

Array = np.ndarray[Any, Any]

# Ops a backend knowingly lacks (op -> why).
KNOWN_ABSENT: dict[str, dict[str, str]] = {
    "torch": {},
    "onnxruntime": {
        "adamw8bit_update": "8-bit optimizer state: round-to-nearest over a 256-entry code "
        "(searchsorted) has no ONNX op; a step using it runs its updates on torch or NumPy",
        "batch_norm_hardtanh": "made only by the C backend's lowering (backends/c/fuse_bn.py)",
        "batch_norm_hardtanh_grad": "made only by the C backend's lowering (backends/c/fuse_bn.py)",
        "batch_norm_apply": "made only by the C backend's lowering (backends/c/fuse_bn.py)",
        "elementwise_chain": "made only by the C backend's lowering (backends/c/fuse_ew.py)",
        **dict.fromkeys(
            ("conv2d_bn_hardtanh", "conv2d_bn_hardtanh_weight_grad"),
            "made only by the C backend's lowering (backends/c/fuse_dw_bn.py)",
        ),
        **dict.fromkeys(
            (
                "layout_convert",
                "conv2d_nhwc",
                "conv2d_nhwc_input_grad",
                "conv2d_nhwc_weight_grad",
                "conv2d_nchwc",
                "conv2d_nchwc_input_grad",
                "conv2d_nchwc_weight_grad",
            ),
            "made only by the C backend's layout pass (backends/c/layout.py)",
        ),
    },
    "c": {},
}


def _one_node(opdef: OpDef, sample: Sample) -> Graph:
    b = GraphBuilder(opdef.name)
    xs = [
        b.input(f"x{i}", TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
        for i, a in enumerate(sample.inputs)
    ]
    return b.build(b.call_multi(opdef.name, *xs, source="test", **sample.attrs))


def _samples(opdef: OpDef) -> list[Sample]:
    return opdef.samples(np.random.default_rng(0)) if opdef.samples else []


def _pure_ops() -> list[OpDef]:
    return [d for _, d in sorted(all_ops().items()) if not d.effectful and d.samples]


def _torch_aliases(opdef: OpDef, sample: Sample, backend: TorchBackend) -> bool:
    """Whether the torch kernel's result shares memory with an input on ``sample``."""
    executable = backend.compile(_one_node(opdef, sample))
    feeds = {f"x{i}": backend.from_numpy(a) for i, a in enumerate(sample.inputs)}
    outs = executable.run({}, feeds)
    ins = {t.untyped_storage().data_ptr() for t in feeds.values() if t.numel()}
    return any(o.numel() and o.untyped_storage().data_ptr() in ins for o in outs)


def undeclared_views() -> list[str]:
    """The ops whose torch kernel aliases an input on some sample but that lack Fact.VIEW."""
    backend = TorchBackend(inplace=False)
    found = []
    for opdef in _pure_ops():
        aliased = any(_torch_aliases(opdef, s, backend) for s in _samples(opdef))
        if aliased and not opdef.has(Fact.VIEW):
            found.append(opdef.name)
    return found


def test_every_op_the_torch_backend_implements_as_a_view_is_declared_a_view() -> None:
    assert undeclared_views() == []


def test_declaring_a_view_op_non_view_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: transpose (a torch view) declared as an ordinary op."""
    transpose = all_ops()["transpose"]
    mutated = dataclasses.replace(transpose, facts=transpose.facts & ~Fact.VIEW)
    monkeypatch.setitem(registry._REGISTRY, "transpose", mutated)
    assert undeclared_views() == ["transpose"]


def test_the_view_check_sees_real_aliasing() -> None:
    """The check is not vacuous: the torch views it knows of do alias their input."""
    backend = TorchBackend(inplace=False)
    for name in ("reshape", "transpose", "slice", "stop_gradient"):
        opdef = all_ops()[name]
        assert any(_torch_aliases(opdef, s, backend) for s in _samples(opdef)), name


def _f32(sample: Sample) -> Sample:
    """The sample in float32 (ONNX Runtime's CPU kernels lack float64 for some ops)."""
    ins = tuple(a.astype(np.float32) if a.dtype == np.float64 else a for a in sample.inputs)
    return Sample(ins, sample.attrs)


_ORT_OPS = [d for d in _pure_ops() if d.name not in KNOWN_ABSENT["onnxruntime"]]


@pytest.mark.parametrize("opdef", _ORT_OPS, ids=lambda d: d.name)
def test_onnxruntime_results_never_alias_inputs(opdef: OpDef) -> None:
    backend = OrtBackend(device="cpu")
    for sample in map(_f32, _samples(opdef)):
        executable = backend.compile(_one_node(opdef, sample))
        feeds = {f"x{i}": backend.from_numpy(a) for i, a in enumerate(sample.inputs)}
        outs = executable.run({}, feeds)
        ins = {v.data_ptr() for v in feeds.values()}
        assert not any(o.data_ptr() in ins for o in outs if np.prod(o.shape()))


def _inplace_line(opdef: OpDef, sample: Sample) -> str | None:
    """The torch source line of ``opdef`` when its inputs are the step's own dying buffers
    (each made by ``neg``), or None when no input has the result's type."""
    b = GraphBuilder(opdef.name)
    fresh = []
    for i, a in enumerate(sample.inputs):
        x = b.input(f"x{i}", TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
        fresh.append(b.call("neg", x))
    out = b.call(opdef.name, *fresh, **sample.attrs)
    if not any(v.type == out.type for v in fresh):
        return None
    generated = generate_source(b.build([out]), KERNELS, _FINDERS, torch.device("cpu"))
    return generated.source.splitlines()[generated.first_line - 1 + len(fresh)]


@pytest.mark.parametrize(
    "opdef", [d for d in _pure_ops() if d.has(Fact.INPLACE)], ids=lambda d: d.name
)
def test_every_inplace_op_is_elementwise_and_its_torch_kernel_writes_with_out(
    opdef: OpDef,
) -> None:
    assert opdef.has(Fact.ELEMENTWISE), opdef.name
    lines = [line for s in _samples(opdef) if (line := _inplace_line(opdef, s)) is not None]
    assert lines, f"{opdef.name}: no sample lets it write in place"
    assert all("out=" in line or "grad_input=" in line for line in lines), lines


def test_facts_are_consistent() -> None:
    for name, d in all_ops().items():
        assert d.has(Fact.EFFECTFUL) == bool(d.mutates), name
        if d.has(Fact.CONSTANT):
            assert d.has(Fact.CREATION), name
        if d.has(Fact.VIEW) or d.has(Fact.INPLACE) or d.has(Fact.SAME_TYPE_IDENTITY):
            assert not d.effectful and d.samples is not None, name
            results = len(d.infer_types(_types(d), _samples(d)[0].attrs))
            assert results == 1, name


def _types(d: OpDef) -> list[TensorType]:
    sample = _samples(d)[0]
    return [TensorType(a.shape, DType.from_numpy(a.dtype)) for a in sample.inputs]


def _tables() -> dict[str, frozenset[str]]:
    return {
        "torch": TorchBackend().supported_ops(),
        "onnxruntime": OrtBackend(device="cpu").supported_ops(),
        "c": CBackend().supported_ops(),
    }


def test_every_op_has_a_kernel_in_every_backend_or_is_knowingly_absent() -> None:
    ops = set(all_ops())
    assert all(callable(d.kernel) for d in all_ops().values())  # the NumPy reference
    for backend, table in _tables().items():
        absent = KNOWN_ABSENT[backend]
        assert sorted(ops - table - absent.keys()) == [], backend
        assert sorted(absent.keys() & table) == [], f"{backend}: listed absent but present"


def test_a_new_elementwise_op_without_kernels_fails_the_coverage_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registering an op (here a copy of ``neg`` under a new name) that no backend has
    makes the coverage check above fail, naming it."""
    neg = all_ops()["neg"]
    monkeypatch.setitem(registry._REGISTRY, "neg_copy", dataclasses.replace(neg, name="neg_copy"))
    with pytest.raises(AssertionError, match="neg_copy"):
        test_every_op_has_a_kernel_in_every_backend_or_is_knowingly_absent()


# -- frontends: every elementwise op has a converter in each, or a reason it has none ------

_FRONTEND_DIR = Path(pockengine.frontend.__file__).parent
# each frontend's converter modules (glob patterns), plus the lowerings they all share
_FRONTEND_FILES = {
    "torch": ("torch/*.py",),
    "onnx": ("onnx/*.py", "loss.py"),
    "jax": ("jax/*.py",),
    "keras": ("keras/*.py", "loss.py"),
}
_SHARED_FILES = ("context.py", "lowering.py", "imported.py", "rng.py")
# Elementwise ops a frontend knowingly never emits (op -> why): the source format has no
# counterpart, so the model's own decomposition arrives as other ops.
_LOWERED = {"elementwise_chain": "made only by the C backend's lowering (backends/c/fuse_ew.py)"}
FRONTEND_ABSENT: dict[str, dict[str, str]] = {
    "torch": {**_LOWERED},
    "onnx": {
        **_LOWERED,
        "log1p": "ONNX has no Log1p; exporters write Log(Add(x, 1))",
        "silu": "no ONNX op below opset 24; exporters write Mul(x, Sigmoid(x))",
        "stop_gradient": "an ONNX graph carries no gradient structure",
    },
    "jax": {
        **_LOWERED,
        "gelu": "jax.nn.gelu traces to tanh/erf primitives",
        "hardtanh": "jax.nn.hard_tanh traces to clamp or max/min",
        "reciprocal": "JAX has no reciprocal primitive (integer_pow -1, div)",
        "silu": "jax.nn.silu traces to logistic and mul",
    },
    "keras": {
        **_LOWERED,
        "gelu": "TF has no Gelu op; keras' gelu traces to Erf/Tanh ops",
        "silu": "tf.nn.silu traces to Sigmoid and Mul",
    },
}


def _ops_named_in(patterns: tuple[str, ...]) -> set[str]:
    """Every string literal in the frontend's converter modules: each converter names the
    IR op it emits (``cx.call("neg", ...)`` or a table ``{"Neg": "neg"}``)."""
    names: set[str] = set()
    for pattern in (*patterns, *_SHARED_FILES):
        for path in sorted(_FRONTEND_DIR.glob(pattern)):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return names


def _frontend_ops() -> list[str]:
    """Elementwise ops a model can contain (``*_grad`` ops only autodiff emits)."""
    return sorted(
        name
        for name, d in all_ops().items()
        if d.has(Fact.ELEMENTWISE) and not name.endswith("_grad")
    )


def test_every_elementwise_op_has_a_converter_in_every_frontend_or_is_knowingly_absent() -> None:
    for frontend, patterns in _FRONTEND_FILES.items():
        named = _ops_named_in(patterns)
        absent = FRONTEND_ABSENT[frontend]
        missing = [op for op in _frontend_ops() if op not in named and op not in absent]
        assert missing == [], f"{frontend} frontend has no converter emitting {missing}"
        stale = sorted(op for op in absent if op in named)
        assert stale == [], f"{frontend}: listed absent but converted: {stale}"


def test_a_new_elementwise_op_without_converters_fails_the_frontend_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An elementwise op registered with kernels but no frontend converter fails above."""
    neg = all_ops()["neg"]
    monkeypatch.setitem(registry._REGISTRY, "neg_copy", dataclasses.replace(neg, name="neg_copy"))
    with pytest.raises(AssertionError, match="neg_copy"):
        test_every_elementwise_op_has_a_converter_in_every_frontend_or_is_knowingly_absent()
