"""ONNX kernels of the shape, indexing and matmul ops.

Scatter-adds (the backward of gather, index and embedding) are ScatterElements and
ScatterND with ``reduction="add"`` into zeros, so repeated indices accumulate as
``np.add.at`` does. Advanced indexing moves the indexed axes to the front, stacks the
broadcast index tensors into one GatherND index and moves the result's axes back where
NumPy puts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.backends.onnx.emitter import Emitter, Kernel, onnx_dtype, registrar
from pockengine.ir import DType, Node
from pockengine.ops._common import broadcast_shapes, norm_axis

__all__ = ["KERNELS", "index_plan", "result_perm", "stacked_index"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


def _int(node: Node, key: str) -> int:
    value = node.attrs[key]
    if not isinstance(value, int):
        raise TypeError(f"{node.op}: {key}={value!r} is not an int")
    return value


def _shape(node: Node, key: str) -> tuple[int, ...]:
    value = node.attrs[key]
    if not isinstance(value, tuple):
        raise TypeError(f"{node.op}: {key}={value!r} is not a shape")
    return tuple(int(d) for d in value)


def _zeros(em: Emitter, shape: Sequence[int], dtype: DType) -> str:
    value = em.onnx.numpy_helper.from_array(np.zeros(1, dtype=dtype.to_numpy()))
    return em.op("ConstantOfShape", em.ints(shape), value=value)


def _transpose(em: Emitter, x: str, perm: Sequence[int]) -> str:
    if list(perm) == sorted(perm):
        return x
    return em.op("Transpose", x, perm=list(perm))


@_k("reshape")
def _reshape(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Reshape", x[0], em.ints(node.output.shape), out=out[0])


@_k("stop_gradient")
def _stop_gradient(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Identity", x[0], out=out[0])


@_k("transpose")
def _transpose_k(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Transpose", x[0], out=out[0], perm=list(_shape(node, "perm")))


@_k("broadcast_to")
def _broadcast_to(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Expand", x[0], em.ints(node.output.shape), out=out[0])


@_k("slice")
def _slice(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    axis = norm_axis(_int(node, "axis"), node.inputs[0].type.rank)
    start, stop, step = (_int(node, k) for k in ("start", "stop", "step"))
    bounds = em.ints([start]), em.ints([stop]), em.ints([axis]), em.ints([step])
    em.op("Slice", x[0], *bounds, out=out[0])


def _pads(rank: int, axis: int, before: int, after: int) -> list[int]:
    pads = [0] * (2 * rank)
    pads[axis], pads[rank + axis] = before, after
    return pads


@_k("slice_grad")
def _slice_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    """Zeros with gz in the slice: spread gz by the step, then pad it into place."""
    shape = _shape(node, "shape")
    rank, axis = len(shape), norm_axis(_int(node, "axis"), len(shape))
    start, step = _int(node, "start"), _int(node, "step")  # the stop is implied by gz's size
    g, m = x[0], node.inputs[0].shape[axis]
    length = m
    if step > 1 and m > 0:
        spread = em.op("Unsqueeze", g, em.ints([axis + 1]))
        spread = em.op("Pad", spread, em.ints(_pads(rank + 1, axis + 1, 0, step - 1)))
        merged = (*shape[:axis], m * step, *shape[axis + 1 :])
        g, length = em.op("Reshape", spread, em.ints(merged)), m * step
    room = shape[axis] - start
    if length > room:
        g = em.op("Slice", g, em.ints([0]), em.ints([room]), em.ints([axis]))
        length = room
    em.op("Pad", g, em.ints(_pads(rank, axis, start, room - length)), out=out[0])


@_k("concat")
def _concat(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Concat", *x, out=out[0], axis=_int(node, "axis"))


@_k("pad")
def _pad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    pairs = node.attrs["pads"]
    assert isinstance(pairs, tuple)
    if not pairs:
        em.op("Identity", x[0], out=out[0])
        return
    flat = [int(p[0]) for p in pairs] + [int(p[1]) for p in pairs]
    value = node.attrs["value"]
    assert isinstance(value, int | float)
    fill = em.scalar(float(value), node.inputs[0].dtype)
    em.op("Pad", x[0], em.ints(flat), fill, out=out[0])


@_k("gather")
def _gather(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("GatherElements", x[0], _i64(em, node, 1, x[1]), out=out[0], axis=_int(node, "axis"))


@_k("gather_grad")
def _gather_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    zeros = _zeros(em, _shape(node, "shape"), node.inputs[0].dtype)
    index = _i64(em, node, 1, x[1])
    em.op(
        "ScatterElements", zeros, index, x[0], out=out[0], axis=_int(node, "axis"), reduction="add"
    )


def _i64(em: Emitter, node: Node, i: int, name: str) -> str:
    if node.inputs[i].dtype is DType.I64:
        return name
    return em.op("Cast", name, to=onnx_dtype(DType.I64))


# -- advanced indexing ------------------------------------------------------------------


def index_plan(
    node: Node, shape: tuple[int, ...], first: int = 1
) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(axes, perm moving them to the front, broadcast index shape); the index tensors are
    the node's inputs from ``first`` on."""
    rank = len(shape)
    axes_attr = node.attrs["axes"]
    assert isinstance(axes_attr, tuple)
    axes = [norm_axis(int(a), rank) for a in axes_attr]
    perm = axes + [d for d in range(rank) if d not in axes]
    batch = broadcast_shapes(*(v.shape for v in node.inputs[first : first + len(axes)]))
    return axes, perm, batch


def stacked_index(
    em: Emitter, node: Node, x: list[str], shape: tuple[int, ...], first: int = 1
) -> str:
    """[*batch, K] int64: the index tensors, negatives wrapped, broadcast and stacked."""
    axes, _, batch = index_plan(node, shape, first)
    columns = []
    for k, (axis, name) in enumerate(zip(axes, x[first:], strict=True)):
        i = _i64(em, node, k + first, name)
        negative = em.op("Less", i, em.scalar(0, DType.I64))
        i = em.op("Where", negative, em.op("Add", i, em.scalar(shape[axis], DType.I64)), i)
        i = em.op("Expand", i, em.ints(batch))
        columns.append(em.op("Unsqueeze", i, em.ints([len(batch)])))
    if len(columns) == 1:
        return columns[0]
    return em.op("Concat", *columns, axis=len(batch))


def result_perm(axes: list[int], n_batch: int, rank: int) -> list[int] | None:
    """How GatherND's [*batch, *rest] goes to NumPy's order (batch in place when the
    indexed axes are adjacent); None when it is already right."""
    first, adjacent = axes[0], axes[-1] - axes[0] == len(axes) - 1
    if not adjacent or first == 0:
        return None
    rest = rank - len(axes)
    return (
        list(range(n_batch, n_batch + first))
        + list(range(n_batch))
        + list(range(n_batch + first, n_batch + rest))
    )


@_k("index")
def _index(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    shape = node.inputs[0].shape
    axes, perm, batch = index_plan(node, shape)
    data = _transpose(em, x[0], perm)
    back = result_perm(axes, len(batch), len(shape))
    gathered = em.op("GatherND", data, stacked_index(em, node, x, shape), out=None)
    if back is None:
        em.op("Identity", gathered, out=out[0])
    else:
        em.op("Transpose", gathered, out=out[0], perm=back)


@_k("index_grad")
def _index_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    shape = _shape(node, "shape")
    axes, perm, batch = index_plan(node, shape)
    back = result_perm(axes, len(batch), len(shape))
    g = x[0]
    if back is not None:
        g = em.op("Transpose", g, perm=[int(i) for i in np.argsort(back)])
    zeros = _zeros(em, [shape[p] for p in perm], node.inputs[0].dtype)
    index = stacked_index(em, node, x, shape)
    scattered = em.op("ScatterND", zeros, index, g, reduction="add")
    inverse = [int(i) for i in np.argsort(perm)]
    if inverse == sorted(inverse):
        em.op("Identity", scattered, out=out[0])
    else:
        em.op("Transpose", scattered, out=out[0], perm=inverse)


@_k("embedding")
def _embedding(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Gather", x[0], _i64(em, node, 1, x[1]), out=out[0], axis=0)


@_k("embedding_grad")
def _embedding_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, ids = node.inputs
    rows, dim = _int(node, "num_rows"), gz.shape[-1]
    count = ids.type.numel
    index = em.op("Reshape", _i64(em, node, 1, x[1]), em.ints([count, 1]))
    updates = em.op("Reshape", x[0], em.ints([count, dim]))
    zeros = _zeros(em, [rows, dim], gz.dtype)
    padding = node.attrs["padding_idx"]
    if padding is None:
        em.op("ScatterND", zeros, index, updates, out=out[0], reduction="add")
        return
    summed = em.op("ScatterND", zeros, index, updates, reduction="add")
    keep = np.ones((rows, 1), dtype=gz.dtype.to_numpy())
    keep[_int(node, "padding_idx") % rows] = 0
    em.op("Mul", summed, em.const(keep), out=out[0])


@_k("linear")
def _linear(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    if node.inputs[0].type.rank == 2:
        em.op("Gemm", *x, out=out[0])
    else:
        em.op("Add", em.op("MatMul", x[0], x[1]), x[2], out=out[0])


@_k("matmul")
def _matmul(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("MatMul", *x, out=out[0])
