"""Indexing ops: gather along an axis, advanced indexing, embedding lookup, and their
scatter-add backward kernels.

Index tensors are i64 (or i32) and never get cotangents; negative index values wrap
as in NumPy. The backward kernels accumulate repeated indices with ``np.add.at``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from pockengine.ir import DType, Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes, norm_axis

__all__ = ["index_key", "indexed_shape"]

_SHAPE = Fact.SHAPE
_INDEX_DTYPES = (DType.I64, DType.I32)


def _zero_flops(ins: object, outs: object, attrs: object) -> int:
    return 0


def _scatter_flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
    return ins[0].numel  # one addition per element of gz


def _check_index(op: str, t: TensorType) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ShapeError(f"{op} needs i64 or i32 indices, got {t}")


def _check_float(op: str, t: TensorType) -> None:
    if not t.dtype.is_float:
        raise ShapeError(f"{op} needs a floating-point tensor, got {t}")


def _attr(c: VJPContext, key: str) -> Any:
    """An attribute passed through unchanged to a backward op."""
    return c.attrs[key]


def _int_attr(c: VJPContext, key: str) -> int:
    value = c.attrs[key]
    if not isinstance(value, int):
        raise ShapeError(f"{c.node.op}: attribute {key}={value!r} is not an int")
    return value


# -- gather ------------------------------------------------------------------------------


def _gather_check(x_shape: tuple[int, ...], index: TensorType, axis: int) -> int:
    _check_index("gather", index)
    if index.rank != len(x_shape) or index.rank == 0:
        raise ShapeError(f"gather needs an index of the same rank >= 1 as {list(x_shape)}: {index}")
    ax = norm_axis(axis, index.rank)
    if any(i > d for k, (i, d) in enumerate(zip(index.shape, x_shape, strict=True)) if k != ax):
        raise ShapeError(f"gather index {index} is larger than {list(x_shape)} off axis {ax}")
    return ax


def _along_axis_key(index: Array, axis: int) -> tuple[Array, ...]:
    """Index arrays picking x[i, j, index[i, j, k], ...]: index on ``axis``, aranges elsewhere."""
    ax = axis % index.ndim
    key = []
    for d, n in enumerate(index.shape):
        if d == ax:
            key.append(index)
        else:
            key.append(np.arange(n).reshape([n if k == d else 1 for k in range(index.ndim)]))
    return tuple(key)


@defop("gather", facts=_SHAPE)
class Gather:
    """torch.gather: z[i, j, k] = x[i, index[i, j, k], k] for axis=1, z has index's shape;
    index.shape[d] <= x.shape[d] off the axis (equal sizes: np.take_along_axis).

    Forward: z = gather(x, index, axis). Backward: gx = gather_grad(gz, index, axis, x.shape).
    """

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, index: TensorType, *, axis: int) -> TensorType:
        _gather_check(x.shape, index, axis)
        return TensorType(index.shape, x.dtype)

    @staticmethod
    def kernel(x: Array, index: Array, *, axis: int) -> Array:
        return np.asarray(x[_along_axis_key(index, axis)])

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, index = c.inputs
        gx = c.call("gather_grad", c.ct, index, axis=_attr(c, "axis"), shape=x.shape)
        return (gx, None)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal((3, 5)), rng.integers(0, 5, (3, 7))), {"axis": 1}),
            Sample((rng.standard_normal((4, 3, 2)), rng.integers(0, 4, (2, 3, 2))), {"axis": 0}),
            Sample((rng.standard_normal((3, 5)), rng.integers(0, 5, (2, 3))), {"axis": -1}),
        ]


@defop("gather_grad", facts=_SHAPE)
class GatherGrad:
    """Scatter-add: z = zeros(shape); z[i, index[i, j, k], k] += gz[i, j, k] for axis=1.

    Backward (it is linear): ggz = gather(gz', index, axis).
    """

    flops = staticmethod(_scatter_flops)

    @staticmethod
    def infer(
        gz: TensorType, index: TensorType, *, axis: int, shape: tuple[int, ...]
    ) -> TensorType:
        _gather_check(tuple(shape), index, axis)
        if gz.shape != index.shape:
            raise ShapeError(f"gather_grad: {gz} does not have the index's shape {index}")
        return TensorType(tuple(shape), gz.dtype)

    @staticmethod
    def kernel(gz: Array, index: Array, *, axis: int, shape: tuple[int, ...]) -> Array:
        out = np.zeros(shape, dtype=gz.dtype)
        np.add.at(out, _along_axis_key(index, axis), gz)
        return out

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("gather", c.ct, c.inputs[1], axis=_attr(c, "axis")), None)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        gz, index = rng.standard_normal((3, 7)), rng.integers(0, 5, (3, 7))
        return [Sample((gz, index), {"axis": 1, "shape": (4, 5)})]


# -- advanced indexing -------------------------------------------------------------------


def indexed_shape(
    op: str, shape: tuple[int, ...], indices: Sequence[TensorType], axes: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape NumPy gives x[key] with the index arrays on ``axes`` and ':' elsewhere.

    The broadcast index shape replaces the indexed axes in place when they are adjacent,
    and leads the result when they are not (NumPy's and ATen's rule).
    """
    if not indices or len(indices) != len(axes):
        raise ShapeError(f"{op} needs one index tensor per axis, got {len(indices)} for {axes}")
    for t in indices:
        _check_index(op, t)
    ax = [norm_axis(a, len(shape)) for a in axes]
    if any(a >= b for a, b in pairwise(ax)):
        raise ShapeError(f"{op} axes {axes} are not distinct and increasing")
    if not shape:
        raise ShapeError(f"{op} cannot index a 0-d tensor")
    batch = broadcast_shapes(*(t.shape for t in indices))
    rest = tuple(d for k, d in enumerate(shape) if k not in ax)
    if ax[-1] - ax[0] == len(ax) - 1:
        return (*shape[: ax[0]], *batch, *shape[ax[-1] + 1 :])
    return (*batch, *rest)


def index_key(rank: int, axes: tuple[int, ...], indices: Sequence[Array]) -> tuple[Any, ...]:
    key: list[Any] = [slice(None)] * rank
    for a, i in zip(axes, indices, strict=True):
        key[norm_axis(a, rank)] = i
    return tuple(key)


@defop("index", facts=_SHAPE)
class Index:
    """NumPy advanced indexing (ATen index.Tensor): z = x[..., i0, ..., i1, ...] with the index
    tensors on ``axes`` (distinct, increasing), broadcast together, and ':' on the other axes.

    Forward: z = index(x, i0, i1, ..., axes). Backward: gx = index_grad(gz, i0, ..., axes,
    x.shape).
    """

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(x: TensorType, *indices: TensorType, axes: tuple[int, ...]) -> TensorType:
        return TensorType(indexed_shape("index", x.shape, indices, tuple(axes)), x.dtype)

    @staticmethod
    def kernel(x: Array, *indices: Array, axes: tuple[int, ...]) -> Array:
        return np.asarray(x[index_key(x.ndim, axes, indices)])

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, *indices = c.inputs
        gx = c.call("index_grad", c.ct, *indices, axes=_attr(c, "axes"), shape=x.shape)
        return (gx, *(None for _ in indices))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((4, 5, 6))
        i = np.array
        return [
            Sample((x, i([[0, 3], [3, -1]])), {"axes": (0,)}),
            Sample((x, i([4, 0, 4])), {"axes": (1,)}),
            Sample((x, i([[1], [3], [1]]), i([0, 4])), {"axes": (0, 1)}),
            Sample((x, i([2, 2]), i([[5], [0], [-2]])), {"axes": (0, 2)}),
            Sample((x, i([0, 3]), i([5, 5])), {"axes": (1, 2)}),
            Sample((x[0], i(3)), {"axes": (-1,)}),
        ]


@defop("index_grad", facts=_SHAPE)
class IndexGrad:
    """Scatter-add: z = zeros(shape); z[..., i0, ..., i1, ...] += gz, repeated indices summed.

    Backward (it is linear): ggz = index(gz', i0, i1, ..., axes).
    """

    flops = staticmethod(_scatter_flops)

    @staticmethod
    def infer(
        gz: TensorType, *indices: TensorType, axes: tuple[int, ...], shape: tuple[int, ...]
    ) -> TensorType:
        expected = indexed_shape("index_grad", tuple(shape), indices, tuple(axes))
        if gz.shape != expected:
            raise ShapeError(f"index_grad: {gz} is not the indexed shape {list(expected)}")
        return TensorType(tuple(shape), gz.dtype)

    @staticmethod
    def kernel(gz: Array, *indices: Array, axes: tuple[int, ...], shape: tuple[int, ...]) -> Array:
        out = np.zeros(shape, dtype=gz.dtype)
        np.add.at(out, index_key(out.ndim, axes, indices), gz)
        return out

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        _, *indices = c.inputs
        gg = c.call("index", c.ct, *indices, axes=_attr(c, "axes"))
        return (gg, *(None for _ in indices))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        i0, i1 = np.array([2, 2]), np.array([[5], [0], [-2]])
        attrs = {"axes": (0, 2), "shape": (4, 5, 6)}
        return [Sample((rng.standard_normal((3, 2, 5)), i0, i1), attrs)]


# -- embedding ---------------------------------------------------------------------------


def _padding_row(padding_idx: int | None, num_rows: int) -> int | None:
    """The padding row counted from 0; a negative padding_idx counts from the end (torch)."""
    if padding_idx is None:
        return None
    if not -num_rows <= padding_idx < num_rows:
        raise ShapeError(f"padding_idx {padding_idx} is out of range for {num_rows} rows")
    return padding_idx % num_rows


@defop("embedding", facts=_SHAPE)
class Embedding:
    """Row lookup (torch F.embedding): z[..., :] = weight[ids[...], :], of shape [*ids, D].

    The row padding_idx is looked up as any other; only its gradient is zero.
    Forward: z = weight[ids]. Backward: gweight = embedding_grad(gz, ids, V, padding_idx).
    """

    flops = staticmethod(_zero_flops)

    @staticmethod
    def infer(weight: TensorType, ids: TensorType, *, padding_idx: int | None) -> TensorType:
        _check_float("embedding", weight)
        _check_index("embedding", ids)
        if weight.rank != 2:
            raise ShapeError(f"embedding needs a [rows, dim] weight, got {weight}")
        _padding_row(padding_idx, weight.shape[0])
        return TensorType((*ids.shape, weight.shape[1]), weight.dtype)

    @staticmethod
    def kernel(weight: Array, ids: Array, *, padding_idx: int | None) -> Array:
        return np.asarray(weight[ids])

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        weight, ids = c.inputs
        num_rows = weight.shape[0]
        gw = c.call(
            "embedding_grad", c.ct, ids, num_rows=num_rows, padding_idx=_attr(c, "padding_idx")
        )
        return (gw, None)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        # The VJP deliberately drops the padding row's gradient (torch semantics), so the
        # adjoint identity holds only where ids never hit that row: row 4 is not in ids. The
        # padding rule itself is checked by embedding_grad's samples and against torch.
        weight, ids = rng.standard_normal((6, 3)), np.array([[0, 2, 5, 2], [1, 1, 2, 3]])
        return [
            Sample((weight, ids), {"padding_idx": 4}),
            Sample((weight, ids), {"padding_idx": None}),
            Sample((weight, ids[0]), {"padding_idx": -2}),
        ]


@defop("embedding_grad", facts=_SHAPE)
class EmbeddingGrad:
    """Scatter-add of rows: z = zeros(num_rows, D); z[ids[...], :] += gz[..., :]; then the row
    padding_idx (if any) is zero.

    Backward (it is linear): ggz = embedding(g', ids) with g' = gz' whose padding row is zeroed.
    """

    flops = staticmethod(_scatter_flops)

    @staticmethod
    def infer(
        gz: TensorType, ids: TensorType, *, num_rows: int, padding_idx: int | None
    ) -> TensorType:
        _check_float("embedding_grad", gz)
        _check_index("embedding_grad", ids)
        if gz.rank != ids.rank + 1 or gz.shape[:-1] != ids.shape:
            raise ShapeError(f"embedding_grad: {gz} is not [*{list(ids.shape)}, dim]")
        _padding_row(padding_idx, num_rows)
        return TensorType((num_rows, gz.shape[-1]), gz.dtype)

    @staticmethod
    def kernel(gz: Array, ids: Array, *, num_rows: int, padding_idx: int | None) -> Array:
        out = np.zeros((num_rows, gz.shape[-1]), dtype=gz.dtype)
        np.add.at(out, ids.reshape(-1), gz.reshape(-1, gz.shape[-1]))
        row = _padding_row(padding_idx, num_rows)
        if row is not None:
            out[row] = 0
        return out

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        ids = c.inputs[1]
        num_rows = _int_attr(c, "num_rows")
        padding_idx = c.attrs["padding_idx"]
        g = c.ct
        if padding_idx is not None:
            # the rows before the padding row, then a zero row, then the rows after it
            row = _padding_row(_int_attr(c, "padding_idx"), num_rows) or 0
            after = c.call("slice", g, axis=0, start=row + 1, stop=num_rows, step=1)
            after = c.call("pad", after, pads=((1, 0), (0, 0)), value=0.0)
            if row:
                before = c.call("slice", g, axis=0, start=0, stop=row, step=1)
                after = c.call("concat", before, after, axis=0)
            g = after
        return (c.call("embedding", g, ids, padding_idx=None), None)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        ids = np.array([[0, 2, 5, 2], [1, 1, 2, 3]])
        gz = rng.standard_normal((2, 4, 3))
        return [
            Sample((gz, ids), {"num_rows": 6, "padding_idx": 2}),
            Sample((gz, ids), {"num_rows": 6, "padding_idx": 0}),
            Sample((gz, ids), {"num_rows": 6, "padding_idx": None}),
        ]
