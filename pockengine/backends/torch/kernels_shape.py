"""The torch kernel table, part two: shape and indexing ops.

Shape ops are views where ATen has one (reshape, permute, expand, narrow), never
copies made ahead of need. Indexing ops wrap negative indices first (``wrap_index``),
since ATen's gather, scatter and embedding kernels reject them and the IR counts them
from the end, as NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal
from pockengine.backends.torch.kernels import out_arg
from pockengine.ops._common import norm_axis

__all__ = ["KERNELS", "NAMESPACE", "embedding_grad_into", "index_list", "wrap_index"]

_aten = torch.ops.aten


def wrap_index(index: torch.Tensor, size: int) -> torch.Tensor:
    """int64 indices with negative values counted from the end, as NumPy (ATen's gather,
    scatter and embedding reject negative indices)."""
    index = index.long()
    return torch.where(index < 0, index + size, index)


def _method(method: str, attr: str) -> Emitter:
    def emit(e: Emit) -> list[str]:
        return [f"{e.out} = {e.ins[0]}.{method}({literal(e.attr(attr))})"]

    return emit


# -- shape -----------------------------------------------------------------------------------
def _stop_gradient(e: Emit) -> list[str]:
    # The input tensor itself (run is under inference_mode: no autograd to detach from);
    # it has Fact.VIEW, so a stored tensor's alias is copied before a write.
    return [f"{e.out} = {e.ins[0]}"]


def _slice(e: Emit) -> list[str]:
    x = e.node.inputs[0]
    axis = norm_axis(e.attr("axis"), x.type.rank)
    start, stop, step = e.attr("start"), e.attr("stop"), e.attr("step")
    if step == 1:
        return [f"{e.out} = aten_narrow({e.ins[0]}, {axis}, {start}, {stop - start})"]
    return [f"{e.out} = aten_slice({e.ins[0]}, {axis}, {start}, {stop}, {step})"]


def _slice_grad(e: Emit) -> list[str]:
    shape = tuple(e.attr("shape"))
    axis = norm_axis(e.attr("axis"), len(shape))
    start, stop, step = e.attr("start"), e.attr("stop"), e.attr("step")
    if step == 1:  # one pass: pad with zeros around the slice
        pairs = [(0, 0)] * len(shape)
        pairs[axis] = (start, shape[axis] - stop)
        return _padded(e, pairs, "0")
    dest = e.dest()
    if dest is not None:  # zeros with the slice's elements copied in, in its slot
        window = f"aten_slice({e.out}, {axis}, {start}, {stop}, {step})"
        return [f"{e.out} = {dest}.zero_()", f"{window}.copy_({e.ins[0]})"]
    args = f"{literal(shape)}, {axis}, {start}, {stop}, {step}"
    return [f"{e.out} = aten_slice_backward({e.ins[0]}, {args})"]


def _flat_pads(pairs: list[tuple[int, int]]) -> str:
    """F.pad's flat list: (before, after) from the last axis backwards."""
    return literal(tuple(p for pair in reversed(pairs) for p in pair))


def _concat(e: Emit) -> list[str]:
    return [f"{e.out} = aten_cat([{', '.join(e.ins)}], {e.attr('axis')}{out_arg(e)})"]


def _pad(e: Emit) -> list[str]:
    pairs = [tuple(p) for p in e.attr("pads")]
    if not any(a or b for a, b in pairs):
        return [f"{e.out} = {e.ins[0]}.clone()"]
    return _padded(e, pairs, literal(e.attr("value")))


def _padded(e: Emit, pairs: list[tuple[int, int]], value: str) -> list[str]:
    """The input with ``pairs`` (before, after) of ``value`` around it on each axis: filled
    and copied into the result's workspace slot where it has one and no pad is negative
    (a crop), else ``constant_pad_nd`` (which allocates)."""
    dest = e.dest()
    if dest is None or any(a < 0 or b < 0 for a, b in pairs):
        return [f"{e.out} = aten_constant_pad_nd({e.ins[0]}, {_flat_pads(pairs)}, {value})"]
    x = e.node.inputs[0]
    inner = ", ".join(f"{a}:{a + d}" for (a, _), d in zip(pairs, x.shape, strict=True))
    return [f"{e.out} = {dest}.fill_({value})", f"{e.out}[{inner}].copy_({e.ins[0]})"]


# -- indexing --------------------------------------------------------------------------------
def _gather(e: Emit) -> list[str]:
    x = e.node.inputs[0]
    axis = norm_axis(e.attr("axis"), x.type.rank)
    index = f"wrap_index({e.ins[1]}, {x.shape[axis]})"
    return [f"{e.out} = aten_gather({e.ins[0]}, {axis}, {index})"]


def _zeros(e: Emit, shape: tuple[int, ...]) -> str:
    return f"aten_zeros({literal(shape)}, dtype={e.dtype(e.node.output.dtype)}, device=dev)"


def _gather_grad(e: Emit) -> list[str]:
    shape = tuple(e.attr("shape"))
    axis = norm_axis(e.attr("axis"), len(shape))
    index = f"wrap_index({e.ins[1]}, {shape[axis]})"
    return [f"{e.out} = {_zeros(e, shape)}.scatter_add_({axis}, {index}, {e.ins[0]})"]


def index_list(e: Emit, rank: int, first: int = 1) -> str:
    """ATen's index list: the index tensors (the node's inputs from ``first`` on) on their
    axes, None on the axes between."""
    axes = [norm_axis(a, rank) for a in e.attr("axes")]
    slots = ["None"] * (max(axes) + 1)
    for a, name in zip(axes, e.ins[first:], strict=True):
        slots[a] = name
    return f"[{', '.join(slots)}]"


def _index(e: Emit) -> list[str]:
    rank = e.node.inputs[0].type.rank
    return [f"{e.out} = aten_index({e.ins[0]}, {index_list(e, rank)})"]


def _index_grad(e: Emit) -> list[str]:
    shape = tuple(e.attr("shape"))
    indices = index_list(e, len(shape))
    return [f"{e.out} = aten_index_put_({_zeros(e, shape)}, {indices}, {e.ins[0]}, True)"]


def _padding_row(padding_idx: int | None, rows: int) -> int:
    """ATen's padding_idx: the row counted from 0, or -1 for none."""
    return -1 if padding_idx is None else padding_idx % rows


def _embedding(e: Emit) -> list[str]:
    rows = e.node.inputs[0].shape[0]
    ids = f"wrap_index({e.ins[1]}, {rows})"
    out = e.node.outputs[0]
    dest = e.dest((math.prod(out.shape[:-1]), out.shape[-1]))
    if dest is None:
        return [f"{e.out} = aten_embedding({e.ins[0]}, {ids})"]
    # ATen's embedding is this row gather; here its rows go straight into the slot
    select = f"aten_index_select({e.ins[0]}, 0, {ids}.reshape(-1), out={dest})"
    return [f"{e.out} = {select}.view({literal(out.shape)})"]


def _embedding_grad(e: Emit) -> list[str]:
    rows = int(e.attr("num_rows"))
    pad = _padding_row(e.attr("padding_idx"), rows)
    ids = f"wrap_index({e.ins[1]}, {rows})"
    dest = e.dest()
    if dest is not None:  # a workspace slot (a table gradient can pass glibc's mmap ceiling)
        return [f"{e.out} = embedding_grad_into({dest}, {e.ins[0]}, {ids}, {pad})"]
    # ATen skips the ids equal to padding_idx: that row stays zero, as the reference.
    return [f"{e.out} = aten_embedding_dense_backward({e.ins[0]}, {ids}, {rows}, {pad}, False)"]


def embedding_grad_into(
    out: torch.Tensor, gz: torch.Tensor, ids: torch.Tensor, pad: int
) -> torch.Tensor:
    """ATen's ``embedding_dense_backward`` written into ``out``: the rows of ``gz`` added
    into the rows ``ids`` name, in order, and row ``pad`` (>= 0) left zero."""
    out.zero_().index_add_(0, ids.reshape(-1), gz.reshape(-1, gz.shape[-1]))
    if pad >= 0:
        out[pad].zero_()
    return out


KERNELS: dict[str, Emitter] = {
    "reshape": _method("reshape", "shape"),
    "transpose": _method("permute", "perm"),
    "broadcast_to": _method("expand", "shape"),
    "stop_gradient": _stop_gradient,
    "slice": _slice,
    "slice_grad": _slice_grad,
    "concat": _concat,
    "pad": _pad,
    "gather": _gather,
    "gather_grad": _gather_grad,
    "index": _index,
    "index_grad": _index_grad,
    "embedding": _embedding,
    "embedding_grad": _embedding_grad,
}

NAMESPACE: dict[str, Callable[..., Any]] = {
    "aten_narrow": torch.narrow,
    "aten_slice": _aten.slice.Tensor,
    "aten_slice_backward": _aten.slice_backward.default,
    "aten_constant_pad_nd": torch.constant_pad_nd,
    "aten_cat": torch.cat,
    "aten_gather": torch.gather,
    "aten_zeros": torch.zeros,
    "aten_index": _aten.index.Tensor,
    "aten_index_put_": _aten.index_put_.default,
    "aten_embedding": torch.embedding,
    "aten_index_select": torch.index_select,
    "aten_embedding_dense_backward": _aten.embedding_dense_backward.default,
    "embedding_grad_into": embedding_grad_into,
    "wrap_index": wrap_index,
}
