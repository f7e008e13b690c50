"""ATen converters: creation, casts, views, slicing, joining, indexing, matrix products."""

from __future__ import annotations

from typing import Any

from pockengine.frontend.compose import flip_axis
from pockengine.frontend.torch.converters import Ctx, aten, ir_dtype, norm_dim
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


# -- creation and casts -------------------------------------------------------------


@aten("full.default", "full_like.default", "zeros_like.default", "ones_like.default")
def _full(cx: Ctx, size_or_like: Any, fill_value: float = 0.0, **kwargs: Any) -> Value:
    t = cx.out_type
    return cx.full(fill_value, t.dtype, t.shape)


@aten("zeros.default", "empty.memory_format", "empty_like.default")
def _zeros(cx: Ctx, *args: Any, **kwargs: Any) -> Value:
    t = cx.out_type  # empty tensors are filled with zeros: their values are unspecified
    return cx.full(0, t.dtype, t.shape)


@aten("ones.default")
def _ones(cx: Ctx, *args: Any, **kwargs: Any) -> Value:
    t = cx.out_type
    return cx.full(1, t.dtype, t.shape)


@aten("scalar_tensor.default")
def _scalar_tensor(cx: Ctx, value: float, **kwargs: Any) -> Value:
    return cx.full(value, cx.out_type.dtype)


@aten("arange.start_step", "arange.start")
def _arange(cx: Ctx, start: float, end: float, step: float = 1, **kwargs: Any) -> Value:
    dtype = str(cx.out_type.dtype)
    return cx.call("arange", start=start, stop=end, step=step, dtype=dtype)


@aten("arange.default")
def _arange_end(cx: Ctx, end: float, **kwargs: Any) -> Value:
    return _arange(cx, 0, end)


@aten("_to_copy.default")
def _to_copy(cx: Ctx, a: Value, dtype: Any = None, **kwargs: Any) -> Value:
    return a if dtype is None else cx.cast(a, ir_dtype(dtype))


@aten("clone.default", "alias.default", "lift_fresh_copy.default")
def _identity(cx: Ctx, a: Value, **kwargs: Any) -> Value:
    # IR values are immutable, so a copy or an alias is the value itself; but
    # decomposition turns tensor.detach() into an alias that remembers it.
    if cx.original == "aten.detach.default":
        return _detach(cx, a)
    return a


@aten("detach.default")
def _detach(cx: Ctx, a: Value) -> Value:
    return cx.call("stop_gradient", a) if a.dtype.is_float else a


@aten("copy.default")
def _copy(cx: Ctx, dst: Value, src: Value, non_blocking: bool = False) -> Value:
    src = cx.cast(src, dst.dtype)
    return src if src.shape == dst.shape else cx.call("broadcast_to", src, shape=dst.shape)


# -- views ------------------------------------------------------------------------


@aten(
    "view.default",
    "_unsafe_view.default",
    "reshape.default",
    "unsqueeze.default",
    "squeeze.dims",
    "squeeze.dim",
    "squeeze.default",
)
def _reshape(cx: Ctx, a: Value, *args: Any) -> Value:
    shape = cx.out_type.shape
    return a if a.shape == shape else cx.call("reshape", a, shape=shape)


@aten("expand.default")
def _expand(cx: Ctx, a: Value, size: Any, implicit: bool = False) -> Value:
    shape = cx.out_type.shape
    return a if a.shape == shape else cx.call("broadcast_to", a, shape=shape)


@aten("permute.default")
def _permute(cx: Ctx, a: Value, dims: list[int]) -> Value:
    return cx.call("transpose", a, perm=tuple(norm_dim(d, a.type.rank) for d in dims))


@aten("t.default", "transpose.int")
def _transpose(cx: Ctx, a: Value, d0: int = 0, d1: int = 1) -> Value:
    perm = list(range(a.type.rank))
    if a.type.rank < 2:
        return a
    i, j = norm_dim(d0, a.type.rank), norm_dim(d1, a.type.rank)
    perm[i], perm[j] = perm[j], perm[i]
    return cx.call("transpose", a, perm=tuple(perm))


def _slice(cx: Ctx, a: Value, dim: int, start: Any, end: Any, step: int = 1) -> Value:
    axis = norm_dim(dim, a.type.rank)
    size = a.shape[axis]
    lo = 0 if start is None else (start + size if start < 0 else start)
    hi = size if end is None else (end + size if end < 0 else end)
    lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
    if (lo, hi, step) == (0, size, 1):
        return a
    return cx.call("slice", a, axis=axis, start=lo, stop=max(hi, lo), step=int(step))


@aten("slice.Tensor")
def _slice_tensor(
    cx: Ctx, a: Value, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Value:
    return _slice(cx, a, dim, start, end, step)


@aten("select.int")
def _select(cx: Ctx, a: Value, dim: int, index: int) -> Value:
    axis = norm_dim(dim, a.type.rank)
    i = index + a.shape[axis] if index < 0 else index
    picked = cx.call("slice", a, axis=axis, start=i, stop=i + 1, step=1)
    return cx.call("reshape", picked, shape=cx.out_type.shape)


@aten("split.Tensor", "split_with_sizes.default")
def _split(cx: Ctx, a: Value, sizes: Any, dim: int = 0) -> list[Value]:
    axis = norm_dim(dim, a.type.rank)
    total = a.shape[axis]
    if isinstance(sizes, int):
        sizes = [min(sizes, total - s) for s in range(0, total, sizes)]
    parts, start = [], 0
    for n in sizes:
        parts.append(_slice(cx, a, axis, start, start + n))
        start += n
    return parts


@aten("unbind.int")
def _unbind(cx: Ctx, a: Value, dim: int = 0) -> list[Value]:
    axis = norm_dim(dim, a.type.rank)
    shape = tuple(d for i, d in enumerate(a.shape) if i != axis)
    return [
        cx.call("reshape", _slice(cx, a, axis, i, i + 1), shape=shape) for i in range(a.shape[axis])
    ]


@aten("cat.default")
def _cat(cx: Ctx, tensors: list[Value], dim: int = 0) -> Value:
    t = cx.out_type
    # ATen lets 1-d empty tensors join anything; they contribute nothing.
    parts = [cx.cast(x, t.dtype) for x in tensors if x.type.numel > 0]
    if not parts:
        return cx.full(0, t.dtype, t.shape)
    if len(parts) == 1:
        return parts[0]
    return cx.call("concat", *parts, axis=norm_dim(dim, t.rank))


@aten("constant_pad_nd.default")
def _pad(cx: Ctx, a: Value, pad: list[int], value: float = 0.0) -> Value:
    rank = a.type.rank
    pairs = [[0, 0] for _ in range(rank)]
    for k in range(len(pad) // 2):
        pairs[rank - 1 - k] = [pad[2 * k], pad[2 * k + 1]]
    grow = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pairs)
    out = a if not any(lo or hi for lo, hi in grow) else cx.call("pad", a, pads=grow, value=value)
    for axis, (lo, hi) in enumerate(pairs):
        if lo < 0 or hi < 0:
            size = out.shape[axis]
            out = _slice(cx, out, axis, -min(lo, 0), size + min(hi, 0))
    return out


# -- indexing ---------------------------------------------------------------------


@aten("gather.default")
def _gather(cx: Ctx, a: Value, dim: int, index: Value, sparse_grad: bool = False) -> Value:
    return cx.call("gather", a, cx.cast(index, DType.I64), axis=norm_dim(dim, a.type.rank))


@aten("index.Tensor")
def _index(cx: Ctx, a: Value, indices: list[Value | None]) -> Value:
    axes = tuple(i for i, idx in enumerate(indices) if idx is not None)
    idx = [x for x in indices if x is not None]
    if any(x.dtype is DType.BOOL for x in idx):
        raise CompileError("indexing with boolean masks is not supported (shapes would be dynamic)")
    return cx.call("index", a, *(cx.cast(x, DType.I64) for x in idx), axes=axes)


@aten("embedding.default")
def _embedding(
    cx: Ctx,
    weight: Value,
    ids: Value,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Value:
    if scale_grad_by_freq:
        raise CompileError("embedding with scale_grad_by_freq is not supported")
    pad = None if padding_idx < 0 else int(padding_idx)
    return cx.call("embedding", weight, cx.cast(ids, DType.I64), padding_idx=pad)


# -- matrix products --------------------------------------------------------------


@aten("mm.default", "bmm.default", "matmul.default")
def _mm(cx: Ctx, a: Value, b: Value) -> Value:
    return cx.call("matmul", a, b)


@aten("addmm.default")
def _addmm(cx: Ctx, bias: Value, a: Value, b: Value, beta: float = 1, alpha: float = 1) -> Value:
    out = cx.call("matmul", a, b)
    if alpha != 1:
        out = cx.call("mul", out, cx.full(alpha, out.dtype))
    if beta != 1:
        bias = cx.call("mul", bias, cx.full(beta, bias.dtype))
    return cx.call("add", out, bias) if beta != 0 else out


@aten("index_select.default")
def _index_select(cx: Ctx, a: Value, dim: int, index: Value) -> Value:
    return cx.call("index", a, cx.cast(index, DType.I64), axes=(norm_dim(dim, a.type.rank),))


@aten("flip.default")
def _flip(cx: Ctx, a: Value, dims: list[int]) -> Value:
    for d in dims:
        a = flip_axis(cx, a, norm_dim(d, a.type.rank))
    return a


@aten("roll.default")
def _roll(cx: Ctx, a: Value, shifts: list[int], dims: list[int] | None = None) -> Value:
    """A cyclic shift: the last ``shift`` elements of an axis, then the rest."""
    if not dims:
        flat = cx.call("reshape", a, shape=(a.type.numel,))
        return cx.call("reshape", _roll(cx, flat, list(shifts)[:1], [0]), shape=a.shape)
    out = a
    for shift, d in zip(shifts, dims, strict=True):
        axis = norm_dim(d, a.type.rank)
        n = a.shape[axis]
        k = int(shift) % n if n else 0
        if k:
            tail = cx.call("slice", out, axis=axis, start=n - k, stop=n, step=1)
            head = cx.call("slice", out, axis=axis, start=0, stop=n - k, step=1)
            out = cx.call("concat", tail, head, axis=axis)
    return out


def _even_offsets(cx: Ctx, count: int) -> int:
    """The bag length of an EmbeddingBag whose offsets are ``arange(0, count, L)`` (what
    ``nn.EmbeddingBag`` makes of a 2-D input): bags of computed offsets have no static
    shape, so any other offsets are a CompileError."""
    node = cx.node.args[2] if cx.node is not None and len(cx.node.args) > 2 else None
    target = str(getattr(node, "target", ""))
    if node is None or not target.startswith("aten.arange"):
        raise CompileError(
            "EmbeddingBag needs a 2-D input (bags of one length); offsets "
            "computed at run time give bags of unknown shape"
        )
    args = [a for a in node.args if isinstance(a, int)]
    start, end, step = [*args, 1][:3] if len(args) >= 2 else (0, args[0] if args else 0, 1)
    if start != 0 or end != count or step <= 0 or count % step:
        raise CompileError(
            f"EmbeddingBag offsets arange({start}, {end}, {step}) do not cut "
            f"{count} ids into bags of one length"
        )
    return int(step)


@aten("_embedding_bag.default", "_embedding_bag_forward_only.default")
def _embedding_bag(
    cx: Ctx,
    weight: Value,
    ids: Value,
    offsets: Value,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: Value | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[Value, None, None, None]:
    """Bags of one length L: the lookups as [bags, L, dim], then their sum (mode 0), mean
    (1) or max (2); ids equal to ``padding_idx`` are left out of a bag, as ATen's."""
    if scale_grad_by_freq or include_last_offset:
        raise CompileError(
            "EmbeddingBag with scale_grad_by_freq or include_last_offset is not supported"
        )
    count = ids.type.numel
    length = _even_offsets(cx, count)
    bags = cx.call("reshape", cx.cast(ids, DType.I64), shape=(count // length, length))
    rows = cx.call("embedding", weight, bags, padding_idx=None)
    keep = None
    if padding_idx is not None and padding_idx >= 0:
        if mode == 2:
            raise CompileError("EmbeddingBag in max mode with padding_idx is not supported")
        kept = cx.call("ne", bags, cx.full(int(padding_idx), DType.I64))
        keep = cx.call("reshape", cx.cast(kept, weight.dtype), shape=(*bags.shape, 1))
        rows = cx.call("mul", rows, keep)
    if per_sample_weights is not None:
        if mode != 0:
            raise CompileError("EmbeddingBag per_sample_weights needs mode='sum'")
        scale = cx.call("reshape", per_sample_weights, shape=(*bags.shape, 1))
        rows = cx.call("mul", rows, cx.cast(scale, weight.dtype))
    if mode == 2:
        return cx.call("amax", rows, axes=(1,), keepdims=False), None, None, None
    total = cx.call("sum", rows, axes=(1,), keepdims=False)
    if mode == 1:
        n = (
            cx.full(float(length), weight.dtype)
            if keep is None
            else cx.call(
                "maximum",
                cx.call("sum", keep, axes=(1,), keepdims=False),
                cx.full(1.0, weight.dtype),
            )
        )
        total = cx.call("div", total, n)
    return total, None, None, None
