"""The torch kernel of ``dequantize``: low-bit codes to a float tensor, one weight at a time.

The result is an ordinary intermediate of the step: the codegen deletes it on the line of
its last read (its matmul), so only the layer being computed has a float copy of its
weight, and the allocator hands the same memory to the next layer's. 4-bit codes stay
packed two a byte in the store; the nibbles are split into a u8 temporary here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal
from pockengine.backends.torch.kernels_loss import KERNELS as LOSS
from pockengine.ops.quant_loss import LOWBIT_LOSS, split_inputs

__all__ = ["KERNELS", "NAMESPACE", "dequantize"]


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    scheme: str,
    group: int,
) -> torch.Tensor:
    """``pockengine.ops.quant.dequantize_array`` in torch, with in-place arithmetic."""
    narrow = scales.dtype in (torch.float16, torch.bfloat16)
    dtype = torch.float32 if narrow else scales.dtype
    *lead, width = codes.shape
    if scheme == "int8":
        q, cols = codes, width
    else:
        cols = 2 * width
        g = codes.view(*lead, cols // group, group // 2)
        q = torch.cat((g & 0x0F, g >> 4), dim=-1)
    w = q.reshape(*lead, cols // group, group).to(dtype)
    if scheme == "int4_sym":
        w.sub_(8)
    w.mul_(scales.to(dtype).unsqueeze(-1))
    if offsets is not None:
        w.add_(offsets.to(dtype).unsqueeze(-1))
    return w.view(*lead, cols)


def _dequantize(e: Emit) -> list[str]:
    codes, scales, *offsets = e.ins
    offset = offsets[0] if offsets else "None"
    scheme, group = literal(e.attr("scheme")), literal(e.attr("group"))
    return [f"{e.out} = pe_dequantize({codes}, {scales}, {offset}, {scheme}, {group})"]


def _dequantize_matmul(e: Emit) -> list[str]:
    x, codes, scales, *offsets = e.ins
    offset = offsets[0] if offsets else "None"
    scheme, group = literal(e.attr("scheme")), literal(e.attr("group"))
    w = f"pe_dequantize({codes}, {scales}, {offset}, {scheme}, {group})"
    return [f"{e.out} = pe_matmul({x}, {w}{'.t()' if e.attr('transpose') else ''})"]


KERNELS: dict[str, Emitter] = {
    "dequantize": _dequantize,
    "dequantize_matmul": _dequantize_matmul,  # the C backend's fused form, unfused
}
NAMESPACE: dict[str, Callable[..., Any]] = {"pe_dequantize": dequantize, "pe_matmul": torch.matmul}


def _lowbit_loss(base: str) -> Emitter:
    """``dequantize_<base>`` (ops/quant_loss.py): the matrix made, then ``base``'s kernel."""
    at = LOWBIT_LOSS[base][1]

    def emit(e: Emit) -> list[str]:
        head, (codes, scales, *offsets) = split_inputs(base, e.ins)
        w = e.tmp()
        offset = offsets[0] if offsets else "None"
        scheme, group = literal(e.attr("scheme")), literal(e.attr("group"))
        head[at] = w
        line = f"{w} = pe_dequantize({codes}, {scales}, {offset}, {scheme}, {group})"
        return [line, *LOSS[base](dataclasses.replace(e, ins=tuple(head)))]

    return emit


for _base in (
    "linear_log_softmax_gather",
    "linear_log_softmax_gather_grad",
    "linear_log_softmax_gather_with_grad",
):
    KERNELS[f"dequantize_{_base}"] = _lowbit_loss(_base)
