"""ATen converters of the selection ops: ``topk`` (mixture-of-experts routers) and
``index_put`` with ``accumulate=True`` (what ``F.fold`` decomposes to: the patches summed
into a zero image at positions computed from ``arange``).

``index_put`` without accumulation (an assignment, where the last of repeated positions
wins) has no IR op: it is a ``CompileError`` naming the op.
"""

from __future__ import annotations

from pockengine.frontend.torch.converters import Ctx, aten, norm_dim
from pockengine.ir import Attrs, CompileError, DType, Value, get_op

__all__: list[str] = []


@aten("topk.default")
def _topk(
    cx: Ctx, x: Value, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[Value, Value]:
    """Always sorted: an unsorted topk may return its entries in any order."""
    axis = norm_dim(dim, x.type.rank)
    values, indices = cx.call_multi("topk", x, k=int(k), axis=axis, largest=bool(largest))
    return values, indices


@aten("index_put.default")
def _index_put(
    cx: Ctx, x: Value, indices: list[Value | None], values: Value, accumulate: bool = False
) -> Value:
    if not accumulate:
        raise CompileError(
            "index_put without accumulate=True (an indexed assignment) is not supported; "
            "x.index_put(indices, values, accumulate=True) and F.fold are"
        )
    given = [v for v in indices if v is not None]
    if not given or any(v.dtype is DType.BOOL for v in given):
        raise CompileError("index_put with boolean masks is not supported (dynamic shapes)")
    axes = tuple(i for i, idx in enumerate(indices) if idx is not None)
    idx = [cx.cast(v, DType.I64) for v in given]
    types = [x.type, *(v.type for v in idx)]
    (indexed,) = get_op("index").infer_types(types, Attrs(axes=axes))
    values = cx.cast(values, x.dtype)
    if values.shape != indexed.shape:
        values = cx.call("broadcast_to", values, shape=indexed.shape)
    return cx.call("index_put_add", x, values, *idx, axes=axes)
