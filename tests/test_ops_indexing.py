"""Shape and indexing ops against torch: forward values and gradients.

Each case runs the op's reference kernel (after checking its shape rule) and its
VJP rule, built into a small graph and run by the NumPy backend, and compares both
with torch (ATen) forward values and ``torch.autograd`` gradients, in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pockengine.ops  # noqa: F401  (registers the ops)
from pockengine.backends.numpy.backend import evaluate
from pockengine.ir import Attrs, DType, GraphBuilder, ShapeError, TensorType, VJPContext, get_op

Array = np.ndarray[Any, Any]


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def _forward(op: str, *inputs: Array, **attrs: Any) -> Array:
    """The reference kernel's result, after checking that the shape rule agrees with it."""
    opdef = get_op(op)
    (t,) = opdef.infer_types([_type_of(a) for a in inputs], Attrs(attrs))
    (out,) = opdef.run(inputs, Attrs(attrs))
    assert (out.shape, DType.from_numpy(out.dtype)) == (t.shape, t.dtype)
    return out


def _grads(op: str, inputs: list[Array], ct: Array, **attrs: Any) -> list[Array | None]:
    """Cotangents of the inputs from the op's VJP rule, run as a graph by the NumPy backend."""
    b = GraphBuilder("vjp")
    xs = [b.input(f"x{i}", _type_of(a)) for i, a in enumerate(inputs)]
    out = b.call(op, *xs, **attrs)
    u = b.input("u", out.type)
    needs = tuple(a.dtype.kind == "f" for a in inputs)
    vjp = get_op(op).vjp
    assert vjp is not None
    grads = vjp(VJPContext(b, b.nodes[-1], (u,), needs))
    graph = b.build([g for g in grads if g is not None])
    feeds = {f"x{i}": a for i, a in enumerate(inputs)}
    got = iter(evaluate(graph, {**feeds, "u": ct}))
    return [next(got) if g is not None else None for g in grads]


def _torch_grads(fn: Any, inputs: list[Array], ct: Array) -> tuple[Array, list[Array | None]]:
    """torch's forward value and the gradients of <fn(inputs), ct> for the float inputs."""
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]
    out = fn(*ts)
    out.backward(torch.tensor(ct))
    grads = [t.grad.numpy() if t.grad is not None else None for t in ts]
    return out.detach().numpy(), grads


def _check_against_torch(op: str, fn: Any, inputs: list[Array], **attrs: Any) -> None:
    got = _forward(op, *inputs, **attrs)
    ct: Array = np.asarray(np.random.default_rng(1).standard_normal(got.shape))
    want, want_grads = _torch_grads(fn, inputs, ct)
    np.testing.assert_allclose(got, want)
    for g, w in zip(_grads(op, inputs, ct, **attrs), want_grads, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


RNG = np.random.default_rng(0)
X3 = RNG.standard_normal((4, 5, 6))


def _i(*values: Any) -> Array:
    return np.array(values, dtype=np.int64)


# ATen index.Tensor takes a list with None for each axis that is not indexed (a full
# slice); trailing axes may be left out. The frontend maps it to index(x, *the
# non-None tensors, axes=the positions of the non-None entries).
INDEX_PATTERNS: dict[str, list[Array | None]] = {
    "axis0": [_i([0, 3], [3, -1])],
    "axis1": [None, _i(4, 0, 4)],
    "axis2": [None, None, _i(-1, 0)],
    "axes01_broadcast": [_i([1], [3], [1]), _i(0, 4)],
    "axes02_apart": [_i(2, 2), None, _i([5], [0], [-2])],
    "axes12": [None, _i(0, 3), _i(5, 5)],
    "axes012": [_i(1, 2), _i(0, 0), _i([3], [4])],
    "axis1_scalar": [None, np.array(3, dtype=np.int64)],
}


def _index_args(pattern: list[Array | None]) -> tuple[list[Array], tuple[int, ...]]:
    axes = tuple(k for k, i in enumerate(pattern) if i is not None)
    return [i for i in pattern if i is not None], axes


@pytest.mark.parametrize("name", sorted(INDEX_PATTERNS))
def test_index_matches_aten_index_tensor(name: str) -> None:
    pattern = INDEX_PATTERNS[name]
    indices, axes = _index_args(pattern)

    def aten_index(x: torch.Tensor, *ts: torch.Tensor) -> torch.Tensor:
        it = iter(ts)
        full = [next(it) if i is not None else None for i in pattern]
        result: torch.Tensor = torch.ops.aten.index.Tensor(x, full)
        return result

    _check_against_torch("index", aten_index, [X3, *indices], axes=axes)
    key: tuple[Any, ...] = tuple(slice(None) if i is None else i for i in pattern)
    np.testing.assert_array_equal(_forward("index", X3, *indices, axes=axes), X3[key])


@pytest.mark.parametrize(
    ("shape", "index_shape", "axis"),
    [
        ((3, 5), (3, 7), 1),
        ((3, 5), (2, 3), -1),
        ((4, 3, 2), (6, 3, 2), 0),
        ((4, 3, 2), (2, 2, 2), 1),
    ],
)
def test_gather_matches_torch(
    shape: tuple[int, ...], index_shape: tuple[int, ...], axis: int
) -> None:
    x = RNG.standard_normal(shape)
    index = RNG.integers(0, shape[axis], index_shape)
    _check_against_torch("gather", lambda t, i: torch.gather(t, axis, i), [x, index], axis=axis)


@pytest.mark.parametrize("padding_idx", [None, 2, 0, -1])
def test_embedding_and_its_gradient_match_torch(padding_idx: int | None) -> None:
    weight = RNG.standard_normal((6, 3))
    ids = _i([0, 2, 5, 2], [1, 1, 2, 5])

    def emb(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, w, padding_idx=padding_idx)

    _check_against_torch("embedding", emb, [weight, ids], padding_idx=padding_idx)
    gz = RNG.standard_normal((2, 4, 3))
    _, (want, _) = _torch_grads(emb, [weight, ids], gz)
    assert want is not None
    got = _forward("embedding_grad", gz, ids, num_rows=6, padding_idx=padding_idx)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if padding_idx is not None:
        assert not got[padding_idx].any()


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_matches_torch_cat(axis: int) -> None:
    shapes: list[tuple[int, ...]] = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    shapes[1] = tuple(5 if k == axis % 3 else d for k, d in enumerate(shapes[1]))
    xs = [RNG.standard_normal(s) for s in shapes]
    _check_against_torch("concat", lambda *ts: torch.cat(ts, axis), xs, axis=axis)


def _pads_from_torch(rank: int, flat: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """F.pad lists (before, after) pairs from the last axis backwards, for trailing axes only."""
    pairs = [(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)]
    return tuple([(0, 0)] * (rank - len(pairs)) + pairs[::-1])


@pytest.mark.parametrize(
    ("flat", "value"), [((1, 2), 0.0), ((0, 1, 3, 0), 2.5), ((1, 1, 0, 0, 2, 1), -1.0)]
)
def test_pad_matches_torch_constant_pad(flat: tuple[int, ...], value: float) -> None:
    x = RNG.standard_normal((2, 3, 4))
    pads = _pads_from_torch(3, flat)
    _check_against_torch("pad", lambda t: F.pad(t, flat, value=value), [x], pads=pads, value=value)


@pytest.mark.parametrize(
    ("axis", "start", "stop", "step"), [(1, 1, 5, 2), (-1, 0, 6, 4), (0, 3, 3, 1)]
)
def test_slice_matches_torch(axis: int, start: int, stop: int, step: int) -> None:
    key = [slice(None)] * 3
    key[axis] = slice(start, stop, step)
    _check_against_torch(
        "slice", lambda t: t[tuple(key)], [X3], axis=axis, start=start, stop=stop, step=step
    )


def test_index_grad_accumulates_repeated_indices() -> None:
    gz = np.ones((3, 6))
    got = _forward("index_grad", gz, _i(1, 1, 3), axes=(0,), shape=(4, 6))
    np.testing.assert_array_equal(got[:, 0], [0.0, 2.0, 0.0, 1.0])


def _type(shape: tuple[int, ...], dtype: DType = DType.F64) -> TensorType:
    return TensorType(shape, dtype)


@pytest.mark.parametrize(
    ("op", "types", "attrs"),
    [
        ("slice", [_type((4, 5))], {"axis": 1, "start": 0, "stop": 6, "step": 1}),
        ("slice", [_type((4, 5))], {"axis": 2, "start": 0, "stop": 1, "step": 1}),
        ("slice", [_type((4, 5))], {"axis": 0, "start": 0, "stop": 1, "step": 0}),
        (
            "slice_grad",
            [_type((2, 5))],
            {"shape": (4, 5), "axis": 0, "start": 0, "stop": 3, "step": 1},
        ),
        ("concat", [_type((2, 3)), _type((2, 4))], {"axis": 0}),
        ("concat", [_type((2, 3)), _type((2, 3), DType.F32)], {"axis": 0}),
        ("pad", [_type((2, 3))], {"pads": ((1, 1),), "value": 0.0}),
        ("pad", [_type((2, 3))], {"pads": ((1, 1), (0, -1)), "value": 0.0}),
        ("gather", [_type((3, 4)), _type((3,), DType.I64)], {"axis": 0}),
        ("gather", [_type((3, 4)), _type((3, 4), DType.F64)], {"axis": 0}),
        ("gather", [_type((3, 4)), _type((4, 4), DType.I64)], {"axis": 1}),
        (
            "index",
            [_type((3, 4, 5)), _type((2,), DType.I64), _type((2,), DType.I64)],
            {"axes": (2, 0)},
        ),
        (
            "index",
            [_type((3, 4)), _type((2,), DType.I64), _type((3,), DType.I64)],
            {"axes": (0, 1)},
        ),
        ("index", [_type((3, 4)), _type((2,), DType.BOOL)], {"axes": (0,)}),
        ("index", [_type((3, 4)), _type((2,), DType.I64)], {"axes": (0, 1)}),
        ("embedding", [_type((6,)), _type((2,), DType.I64)], {"padding_idx": None}),
        ("embedding", [_type((6, 3), DType.I64), _type((2,), DType.I64)], {"padding_idx": None}),
        ("embedding", [_type((6, 3)), _type((2,), DType.I64)], {"padding_idx": 6}),
        (
            "embedding_grad",
            [_type((2, 4)), _type((3,), DType.I64)],
            {"num_rows": 5, "padding_idx": None},
        ),
    ],
)
def test_bad_shapes_raise_shape_error(
    op: str, types: list[TensorType], attrs: dict[str, Any]
) -> None:
    with pytest.raises(ShapeError):
        get_op(op).infer_types(types, Attrs(attrs))
