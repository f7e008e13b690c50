"""Elementwise ops and reductions against torch: forward values, gradients, dtypes, masks.

Each case runs the op's reference kernel (after checking its shape rule) and its
VJP rule, built into a small graph and run by the NumPy backend, and compares both
with torch (ATen) forward values and ``torch.autograd`` gradients, in float64. The
points where ATen picks a subgradient (ties, bounds, zero) are tested on purpose.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pockengine.ops  # noqa: F401  (registers the ops)
from pockengine.backends.numpy.backend import evaluate
from pockengine.ir import (
    Attrs,
    DType,
    GraphBuilder,
    Sample,
    ShapeError,
    TensorType,
    VJPContext,
    all_ops,
    get_op,
)

Array = np.ndarray[Any, Any]

_MODULES = ("activation", "elementwise", "reduce", "unary")
_MY_OPS = sorted(
    name
    for name, opdef in all_ops().items()
    if opdef.kernel.__module__.rsplit(".", 1)[-1] in _MODULES and opdef.samples is not None
)


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def _forward(op: str, *inputs: Array, **attrs: Any) -> Array:
    """The reference kernel's result, after checking that the shape rule agrees with it."""
    opdef = get_op(op)
    (t,) = opdef.infer_types([_type_of(a) for a in inputs], Attrs(attrs))
    (out,) = opdef.run(inputs, Attrs(attrs))
    assert isinstance(out, np.ndarray)
    assert (out.shape, DType.from_numpy(out.dtype)) == (t.shape, t.dtype)
    return out


def _grads(op: str, inputs: list[Array], ct: Array, **attrs: Any) -> list[Array | None]:
    """Cotangents of the inputs from the op's VJP rule, summed back to the input shapes."""
    b = GraphBuilder("vjp")
    xs = [b.input(f"x{i}", _type_of(a)) for i, a in enumerate(inputs)]
    out = b.call(op, *xs, **attrs)
    u = b.input("u", out.type)
    needs = tuple(a.dtype.kind == "f" for a in inputs)
    vjp = get_op(op).vjp
    assert vjp is not None
    grads = list(vjp(VJPContext(b, b.nodes[-1], (u,), needs)))
    for i, (x, g) in enumerate(zip(xs, grads, strict=True)):
        if g is not None and g.shape != x.shape:
            grads[i] = b.call("sum_to", g, shape=x.shape)
    graph = b.build([g for g in grads if g is not None])
    feeds = {f"x{i}": a for i, a in enumerate(inputs)}
    got = iter(evaluate(graph, {**feeds, "u": ct}))
    return [next(got) if g is not None else None for g in grads]


def _check(op: str, fn: Any, inputs: list[Array], **attrs: Any) -> None:
    """Forward value and gradients of ``op`` match torch's ``fn`` on the same inputs."""
    got = _forward(op, *inputs, **attrs)
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]
    want = fn(*ts)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-14)
    if not want.requires_grad:
        return
    ct = np.asarray(np.random.default_rng(3).standard_normal(got.shape))
    want.backward(torch.tensor(ct))
    grads = _grads(op, inputs, ct, **attrs)
    for g, t in zip(grads, ts, strict=True):
        if t.grad is None:
            assert g is None
        else:
            assert g is not None
            np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-14)


_RNG = np.random.default_rng(0)
_X = _RNG.uniform(-3.0, 3.0, (3, 4))
_POS = _RNG.uniform(0.2, 3.0, (3, 4))

_UNARY = [
    ("neg", torch.neg, _X),
    ("exp", torch.exp, _X),
    ("log", torch.log, _POS),
    ("sqrt", torch.sqrt, _POS),
    ("rsqrt", torch.rsqrt, _POS),
    ("tanh", torch.tanh, _X),
    ("sigmoid", torch.sigmoid, _X),
    ("relu", torch.relu, np.append(_X, 0.0)),
    ("silu", F.silu, _X),
    ("sin", torch.sin, _X),
    ("cos", torch.cos, _X),
    ("abs", torch.abs, np.append(_X, 0.0)),
    ("reciprocal", torch.reciprocal, _POS),
    ("erf", torch.erf, _X),
]


@pytest.mark.parametrize(("op", "fn", "x"), _UNARY, ids=[c[0] for c in _UNARY])
def test_unary_matches_torch(op: str, fn: Any, x: Array) -> None:
    _check(op, fn, [x])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(approximate: str) -> None:
    _check("gelu", lambda t: F.gelu(t, approximate=approximate), [_X], approximate=approximate)


def test_clamp_passes_gradient_at_the_bounds_hardtanh_does_not() -> None:
    x = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
    _check("clamp", lambda t: torch.clamp(t, -0.5, 0.5), [x], min=-0.5, max=0.5)
    _check("clamp", lambda t: torch.clamp(t, max=0.0), [x], min=None, max=0.0)
    _check("clamp", lambda t: torch.clamp(t, min=0.0), [x], min=0.0, max=None)
    _check("hardtanh", lambda t: F.hardtanh(t, -0.5, 0.5), [x], min_val=-0.5, max_val=0.5)
    _check("hardtanh", F.relu6, [x * 6.0 + 3.0], min_val=0.0, max_val=6.0)


@pytest.mark.parametrize("exponent", [0, 1, 3, 0.5, -1.5, 2.5])
def test_pow_scalar_matches_torch(exponent: float) -> None:
    x = _POS if exponent != int(exponent) else _X
    _check("pow_scalar", lambda t: torch.pow(t, exponent), [x], exponent=exponent)


def test_pow_scalar_of_integers_stays_integer() -> None:
    out = _forward("pow_scalar", np.arange(-3, 4), exponent=2.0)
    np.testing.assert_array_equal(out, np.arange(-3, 4) ** 2)


_TIES_X = np.array([[1.0, 2.0, 3.0, 0.5], [2.0, -1.0, 2.0, 4.0], [0.0, 0.0, 5.0, 1.0]])
_TIES_Y = np.array([1.0, 2.0, 3.0, 4.0])

_BINARY = [
    ("sub", torch.sub, [_X, _X[0]]),
    ("div", torch.div, [_X, _POS[:1]]),
    ("maximum", torch.maximum, [_TIES_X, _TIES_Y]),
    ("minimum", torch.minimum, [_TIES_X, _TIES_Y]),
    ("eq", torch.eq, [_TIES_X, _TIES_Y]),
    ("ne", torch.ne, [_TIES_X, _TIES_Y]),
    ("lt", torch.lt, [_TIES_X, _TIES_Y]),
    ("le", torch.le, [_TIES_X, _TIES_Y]),
    ("gt", torch.gt, [_TIES_X, _TIES_Y]),
    ("ge", torch.ge, [_TIES_X, _TIES_Y]),
    ("logical_and", torch.logical_and, [_TIES_X > 1, _TIES_Y > 2]),
    ("logical_or", torch.logical_or, [_TIES_X > 1, _TIES_Y > 2]),
    ("logical_not", torch.logical_not, [_TIES_X > 1]),
    ("where", torch.where, [_TIES_X[:, :1] > 0.5, _X, _TIES_Y]),
]


@pytest.mark.parametrize(("op", "fn", "inputs"), _BINARY, ids=[c[0] for c in _BINARY])
def test_binary_matches_torch(op: str, fn: Any, inputs: list[Array]) -> None:
    _check(op, fn, inputs)


_REDUCE = [
    ("mean", lambda t: t.mean(dim=(0, 2), keepdim=True), {"axes": (0, -1), "keepdims": True}),
    ("mean", lambda t: t.mean(), {"axes": None, "keepdims": False}),
    ("amax", lambda t: t.amax(dim=1), {"axes": (1,), "keepdims": False}),
    ("amax", lambda t: t.amax(), {"axes": (), "keepdims": False}),
    ("any", lambda t: t.any(dim=2, keepdim=True), {"axes": (2,), "keepdims": True}),
    ("softmax", lambda t: torch.softmax(t, 1), {"axis": 1}),
    ("log_softmax", lambda t: torch.log_softmax(t, -1), {"axis": -1}),
]


@pytest.mark.parametrize(("op", "fn", "attrs"), _REDUCE, ids=[c[0] for c in _REDUCE])
def test_reduction_matches_torch(op: str, fn: Any, attrs: dict[str, Any]) -> None:
    x = np.round(_RNG.uniform(-2.0, 2.0, (2, 3, 4)), 0)  # rounded: amax has ties
    _check(op, fn, [x > 1 if op == "any" else x], **attrs)


def test_cast_gradient_goes_back_to_the_input_dtype() -> None:
    x = _X.astype(np.float32)
    out = _forward("cast", x, dtype="f64")
    assert out.dtype == np.float64
    (g,) = _grads("cast", [x], np.ones_like(out), dtype="f64")
    assert g is not None and g.dtype == np.float32
    np.testing.assert_array_equal(
        _forward("cast", np.array([-1.7, 0.0, 2.9]), dtype="i64"), [-1, 0, 2]
    )


@pytest.mark.parametrize(
    ("start", "stop", "step", "dtype"),
    [
        (0, 10, 3, "i64"),
        (5, -2, -2, "i64"),
        (0.5, 2.0, 0.1, "f32"),
        (0, 1, 0.3, "f64"),
        (3, 3, 1, "f32"),
    ],
)
def test_arange_matches_torch(start: float, stop: float, step: float, dtype: str) -> None:
    got = _forward("arange", start=start, stop=stop, step=step, dtype=dtype)
    want = torch.arange(start, stop, step, dtype=getattr(torch, DType(dtype).to_numpy().name))
    np.testing.assert_array_equal(got, want.numpy())


# -- dtypes -------------------------------------------------------------------
def _as_f32(sample: Sample) -> tuple[Array, ...]:
    return tuple(a.astype(np.float32) if a.dtype == np.float64 else a for a in sample.inputs)


@pytest.mark.parametrize("op", _MY_OPS)
def test_float32_inputs_give_the_dtype_the_shape_rule_says(op: str) -> None:
    opdef = get_op(op)
    assert opdef.samples is not None
    for sample in opdef.samples(np.random.default_rng(0)):
        _forward(op, *_as_f32(sample), **sample.attrs)


# -- random_mask ----------------------------------------------------------------
def _mask(seed: int, shape: tuple[int, ...], p: float, salt: int) -> Array:
    return _forward("random_mask", np.asarray(seed, dtype=np.int64), shape=shape, p=p, salt=salt)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_random_mask_keeps_one_minus_p_scaled(p: float) -> None:
    m = _mask(7, (100, 1000), p, 1)
    kept = m != 0
    assert abs(kept.mean() - (1 - p)) < 0.02
    assert np.all(m[kept] == np.float32(1 / (1 - p)))
    assert m.dtype == np.float32


def test_random_mask_extremes() -> None:
    assert np.all(_mask(3, (50,), 0.0, 0) == 1.0)
    assert np.all(_mask(3, (50,), 1.0, 0) == 0.0)


def test_random_mask_depends_on_seed_and_salt_only() -> None:
    base = _mask(7, (100, 1000), 0.5, 1)
    np.testing.assert_array_equal(base, _mask(7, (100, 1000), 0.5, 1))
    for other in (_mask(8, (100, 1000), 0.5, 1), _mask(7, (100, 1000), 0.5, 2)):
        agree = float(np.mean((base != 0) == (other != 0)))
        assert abs(agree - 0.5) < 0.02  # independent masks agree half the time


def _torch_mix(h: torch.Tensor) -> torch.Tensor:
    m = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m
    h = h ^ (h >> 15)
    h = (h * 0x6A09E667) & m
    return h ^ (h >> 16)


def _torch_mask(seed: int, n: int, p: float, salt: int) -> torch.Tensor:
    """The hash exactly as random_mask's docstring states it, in torch int64."""
    m = 0xFFFFFFFF
    s = torch.tensor(seed, dtype=torch.int64)
    key = _torch_mix(torch.tensor(salt & m, dtype=torch.int64))
    key = _torch_mix(_torch_mix(key ^ (s & m)) ^ ((s >> 32) & m))
    i = torch.arange(n, dtype=torch.int64)
    h = _torch_mix(_torch_mix(key ^ (i & m)) ^ (i >> 32))
    kept = h.double() / 2.0**32 >= p
    return torch.where(kept, torch.tensor(1 / (1 - p), dtype=torch.float32), 0.0)


@pytest.mark.parametrize(
    ("seed", "salt"), [(0, 0), (12345, 3), (-1, 7), (2**40 + 5, -2), (-(2**62), 1)]
)
def test_random_mask_is_reproduced_bit_exactly_by_torch(seed: int, salt: int) -> None:
    got = _mask(seed, (64, 97), 0.3, salt)
    want = _torch_mask(seed, 64 * 97, 0.3, salt).reshape(64, 97)
    np.testing.assert_array_equal(got, want.numpy())


_REJECTED = [
    ("exp", [np.arange(3)], {}),
    ("div", [np.arange(3), np.arange(3)], {}),
    ("sub", [np.ones(3), np.ones(3, dtype=np.float32)], {}),
    ("where", [np.ones(3), np.ones(3), np.ones(3)], {}),
    ("logical_and", [np.ones(3), np.ones(3)], {}),
    ("logical_not", [np.ones(3)], {}),
    ("gelu", [np.ones(3)], {"approximate": "erf"}),
    ("pow_scalar", [np.arange(3)], {"exponent": 0.5}),
    ("softmax", [np.ones((2, 3))], {"axis": 2}),
    ("random_mask", [np.ones(())], {"shape": (2,), "p": 0.5, "salt": 0}),
    ("random_mask", [np.asarray(1)], {"shape": (2,), "p": 1.5, "salt": 0}),
    ("arange", [], {"start": 0, "stop": 3, "step": 0, "dtype": "i64"}),
    ("arange", [], {"start": 0, "stop": 3, "step": 0.5, "dtype": "i64"}),
]


@pytest.mark.parametrize(("op", "inputs", "attrs"), _REJECTED, ids=[c[0] for c in _REJECTED])
def test_shape_rule_rejects(op: str, inputs: list[Array], attrs: dict[str, Any]) -> None:
    with pytest.raises(ShapeError):
        get_op(op).infer_types([_type_of(a) for a in inputs], Attrs(attrs))
