"""Selection ops: the k largest (or smallest) entries along an axis, and the scatter-add of
values into a copy of a tensor (ATen's ``index_put`` with ``accumulate=True``).

``topk`` is the router of mixture-of-experts layers (softmax over the k best logits);
``index_put_add`` is what ``F.fold`` lowers to (overlapping patches summed into an image)
and what a model writing ``x.index_put_(idx, v, accumulate=True)`` runs. Index tensors
are i64 (or i32) and never get cotangents; negative index values wrap as in NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import DType, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import norm_axis
from pockengine.ops.indexing import index_key, indexed_shape

__all__: list[str] = []


# -- topk ----------------------------------------------------------------------------------


def _topk_axis(x: TensorType, k: int, axis: int) -> int:
    if x.rank == 0:
        raise ShapeError(f"topk needs a tensor of rank >= 1, got {x}")
    ax = norm_axis(axis, x.rank)
    if not 0 <= k <= x.shape[ax]:
        raise ShapeError(f"topk: k={k} is outside [0, {x.shape[ax]}] for axis {ax} of {x}")
    return ax


@defop("topk")
class TopK:
    """torch.topk: the ``k`` largest (``largest=False``: smallest) entries of ``x`` along
    ``axis``, sorted best first, and their positions (i64). Equal entries keep their order
    (the first position first). Result shape: ``x``'s with ``k`` on the axis.

    Forward: values, indices = topk(x, k, axis, largest). Backward: each picked entry's
    cotangent goes back to the position it came from, gx = gather_grad(gvalues, indices,
    axis, x.shape); the indices have none.
    """

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return ins[0].numel  # one comparison per element, at least

    @staticmethod
    def infer(
        x: TensorType, *, k: int, axis: int, largest: bool = True
    ) -> tuple[TensorType, TensorType]:
        if not (x.dtype.is_float or x.dtype in (DType.I64, DType.I32)):
            raise ShapeError(f"topk needs a float or signed integer tensor, got {x}")
        ax = _topk_axis(x, k, axis)
        shape = tuple(k if d == ax else n for d, n in enumerate(x.shape))
        return TensorType(shape, x.dtype), TensorType(shape, DType.I64)

    @staticmethod
    def kernel(x: Array, *, k: int, axis: int, largest: bool = True) -> tuple[Array, Array]:
        ax = axis % x.ndim
        keys = -x if largest else x  # a stable ascending sort of the keys: ties keep order
        order = np.argsort(keys, axis=ax, kind="stable")
        indices = np.take(order, np.arange(k), axis=ax).astype(np.int64)
        return np.take_along_axis(x, indices, axis=ax), indices

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        gvalues = c.cts[0]
        if gvalues is None or not c.needs[0]:
            return (None,)
        x = c.inputs[0]
        indices = c.node.outputs[1]
        axis = c.attrs["axis"]
        return (c.call("gather_grad", gvalues, indices, axis=axis, shape=x.shape),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal((3, 5)),), {"k": 2, "axis": -1}),
            Sample((rng.standard_normal((4, 3, 2)),), {"k": 3, "axis": 0, "largest": False}),
            Sample((rng.standard_normal((2, 6)),), {"k": 6, "axis": 1}),
            Sample((rng.standard_normal((7,)),), {"k": 1, "axis": 0}),
        ]


# -- index_put with accumulation -------------------------------------------------------------


@defop("index_put_add")
class IndexPutAdd:
    """ATen's index_put(x, indices, values, accumulate=True): z = copy of x, then
    z[..., i0, ..., i1, ...] += values, repeated positions summed. ``values`` has the
    indexed shape (``index``'s result shape for the same indices and ``axes``).

    Forward: z = index_put_add(x, values, i0, i1, ..., axes). Backward: gx = gz,
    gvalues = index(gz, i0, i1, ..., axes).
    """

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return ins[1].numel  # one addition per value

    @staticmethod
    def infer(
        x: TensorType, values: TensorType, *indices: TensorType, axes: tuple[int, ...]
    ) -> TensorType:
        expected = indexed_shape("index_put_add", x.shape, indices, tuple(axes))
        if values.shape != expected or values.dtype != x.dtype:
            raise ShapeError(
                f"index_put_add: values {values} are not {x.dtype}{list(expected)}, "
                f"the indexed part of {x}"
            )
        return x

    @staticmethod
    def kernel(x: Array, values: Array, *indices: Array, axes: tuple[int, ...]) -> Array:
        out = np.array(x, copy=True)
        np.add.at(out, index_key(out.ndim, axes, indices), values)
        return out

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        _, _, *indices = c.inputs
        gx = c.ct if c.needs[0] else None
        gv = c.call("index", c.ct, *indices, axes=c.attrs["axes"]) if c.needs[1] else None
        return (gx, gv, *(None for _ in indices))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x, i = rng.standard_normal((4, 5, 6)), np.array
        cases = [
            ((2, 2, 5, 6), [i([[0, 3], [3, -1]])], (0,)),
            ((4, 3, 6), [i([4, 0, 4])], (1,)),
            ((3, 2, 6), [i([[1], [3], [1]]), i([0, 4])], (0, 1)),
            ((3, 2, 5), [i([2, 2]), i([[5], [0], [-2]])], (0, 2)),
        ]
        return [
            Sample((x, rng.standard_normal(shape), *indices), {"axes": axes})
            for shape, indices, axes in cases
        ]
