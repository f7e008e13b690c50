"""Op table tests, generated from every registered op's sample inputs.

- the shape rule agrees with the reference kernel's output (shape and dtype);
- each VJP passes the adjoint identity <J v, u> = <v, J^T u> in float64, with
  J v from central finite differences of the reference kernel;
- an op whose gradient is zero by definition (Fact.NO_GRADIENT: stop_gradient) has a VJP,
  so autodiff can cross it, and that VJP gives no cotangent to any input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pockengine.ops  # noqa: F401  (registers the ops)
from pockengine.backends.numpy.backend import evaluate
from pockengine.ir import (
    Attrs,
    DType,
    Fact,
    GraphBuilder,
    OpDef,
    Role,
    Sample,
    TensorType,
    VJPContext,
    all_ops,
)

Array = np.ndarray[Any, Any]


def _cases(with_vjp: bool, no_gradient: bool = False) -> list[Any]:
    """Sample cases of every op; with_vjp: of the ops with a VJP whose Fact.NO_GRADIENT
    equals ``no_gradient``."""
    cases = []
    for name, opdef in sorted(all_ops().items()):
        if opdef.samples is None:
            continue
        if with_vjp and (opdef.vjp is None or opdef.has(Fact.NO_GRADIENT) != no_gradient):
            continue
        for i, sample in enumerate(opdef.samples(np.random.default_rng(0))):
            cases.append(pytest.param(opdef, sample, id=f"{name}-{i}"))
    return cases


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def test_every_op_has_samples_and_docs() -> None:
    missing = [n for n, d in all_ops().items() if d.samples is None and not d.has(Fact.CREATION)]
    assert not missing, f"ops without sample inputs: {missing}"
    undocumented = [n for n, d in all_ops().items() if not d.doc]
    assert not undocumented, f"ops without a docstring: {undocumented}"


@pytest.mark.parametrize(("opdef", "sample"), _cases(with_vjp=False))
def test_shape_rule_matches_kernel(opdef: OpDef, sample: Sample) -> None:
    types = opdef.infer_types([_type_of(a) for a in sample.inputs], Attrs(sample.attrs))
    outs = opdef.run(sample.inputs, Attrs(sample.attrs))
    if opdef.effectful:
        assert types == ()
        assert len(outs) == len(opdef.mutates)
        return
    assert len(outs) == len(types)
    for t, a in zip(types, outs, strict=True):
        assert tuple(a.shape) == t.shape, (opdef.name, a.shape, t)
        assert DType.from_numpy(a.dtype) == t.dtype, (opdef.name, a.dtype, t)


def _vjp(opdef: OpDef, sample: Sample, cts: list[Array | None]) -> list[Array | None]:
    b = GraphBuilder("vjp")
    xs = [b.input(f"x{i}", _type_of(a)) for i, a in enumerate(sample.inputs)]
    outs = b.call_multi(opdef.name, *xs, **sample.attrs)
    us = [
        b.input(f"u{i}", o.type) if ct is not None else None
        for i, (o, ct) in enumerate(zip(outs, cts, strict=True))
    ]
    needs = tuple(a.dtype.kind == "f" for a in sample.inputs)
    grads = opdef.vjp(VJPContext(b, b.nodes[-1], tuple(us), needs))  # type: ignore[misc]
    result: list[Any] = []
    for x, g in zip(xs, grads, strict=True):
        if g is not None and g.shape != x.shape:
            g = b.call("sum_to", g, shape=x.shape)  # autodiff undoes broadcasting like this
        result.append(g)
    graph = b.build([g for g in result if g is not None])
    feeds = {f"x{i}": a for i, a in enumerate(sample.inputs)}
    feeds.update({f"u{i}": ct for i, ct in enumerate(cts) if ct is not None})
    got = iter(evaluate(graph, feeds))
    return [next(got) if g is not None else None for g in result]


@pytest.mark.parametrize(("opdef", "sample"), _cases(with_vjp=True))
def test_vjp_adjoint_identity(opdef: OpDef, sample: Sample) -> None:
    rng = np.random.default_rng(1)
    attrs = Attrs(sample.attrs)
    base = opdef.run(sample.inputs, attrs)
    cts = [rng.standard_normal(o.shape) if o.dtype.kind == "f" else None for o in base]
    grads = _vjp(opdef, sample, cts)
    float_in = [i for i, a in enumerate(sample.inputs) if a.dtype.kind == "f"]
    vs = {i: rng.standard_normal(sample.inputs[i].shape) for i in float_in}
    eps = 1e-6

    def shifted(sign: float) -> tuple[Array, ...]:
        xs = [a + sign * eps * vs[i] if i in vs else a for i, a in enumerate(sample.inputs)]
        return opdef.run(xs, attrs)

    plus, minus = shifted(1.0), shifted(-1.0)
    jvp_dot_u = sum(
        float(np.sum((p - m) / (2 * eps) * u))
        for p, m, u in zip(plus, minus, cts, strict=True)
        if u is not None
    )
    v_dot_vjp = sum(float(np.sum(vs[i] * grads[i])) for i in float_in if grads[i] is not None)
    assert v_dot_vjp == pytest.approx(jvp_dot_u, rel=1e-5, abs=1e-7), opdef.name


@pytest.mark.parametrize(("opdef", "sample"), _cases(with_vjp=True, no_gradient=True))
def test_vjp_of_a_no_gradient_op_gives_no_cotangent(opdef: OpDef, sample: Sample) -> None:
    outs = opdef.run(sample.inputs, Attrs(sample.attrs))
    cts = [np.ones_like(o) if o.dtype.kind == "f" else None for o in outs]
    assert _vjp(opdef, sample, cts) == [None] * len(sample.inputs)


def test_no_gradient_ops_have_a_vjp_for_autodiff_to_cross() -> None:
    held = {n: d for n, d in all_ops().items() if d.has(Fact.NO_GRADIENT)}
    assert "stop_gradient" in held
    assert all(d.vjp is not None for d in held.values())


def test_role_is_kept_by_builder() -> None:
    b = GraphBuilder("g")
    w = b.input("w", TensorType((2,), DType.F32), Role.PARAM, trainable=True)
    assert w.role is Role.PARAM and w.trainable
