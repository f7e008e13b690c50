"""Torch kernels of ``attention`` and ``attention_grad``.

On CPU both run ATen's fused flash-attention kernels
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which never store
the [B, H, L, S] probabilities: the backward recomputes them block by block from q, k
and the log-sum-exp. Elsewhere (CUDA, or value heads of another size than the query's)
the same math runs as matmuls and a softmax, materialising the scores for the call.
Neither has an ``out=`` form: with a workspace, the results are copied into their slots
at once (``kernels.slot_copies``; ``heap.COPIED_OPS``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal
from pockengine.backends.torch.kernels import slot_copies

__all__ = ["KERNELS", "NAMESPACE"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(e: Emit) -> bool:
    first = 0 if e.node.op == "attention" else 1  # attention_grad's inputs start with gout
    q, v = e.node.inputs[first], e.node.inputs[first + 2]
    return e.device.type == "cpu" and q.shape[3] == v.shape[3]


def _args(e: Emit, first: int, stmts: list[str]) -> tuple[str, str]:
    """The ``attn_mask=..., scale=...`` keywords and the causal flag; a mask of rank < 4
    (input ``first``) viewed as rank 4."""
    node = e.node
    mask = "None"
    if len(node.inputs) > first:
        mask = e.ins[first]
        shape = node.inputs[first].shape
        if len(shape) < 4:
            mask = e.tmp()
            stmts.append(
                f"{mask} = {e.ins[first]}.view({literal((1,) * (4 - len(shape)) + shape)})"
            )
    scale = literal(float(e.attr("scale")))
    return f"attn_mask={mask}, scale={scale}", literal(bool(e.attr("causal")))


def _attention(e: Emit) -> list[str]:
    stmts: list[str] = []
    q, k, v = e.ins[:3]
    kw, causal = _args(e, 3, stmts)
    fn = "flash_attention" if _fused(e) else "attention_math"
    stmts.append(f"{', '.join(e.outs)} = {fn}({q}, {k}, {v}, {causal}, {kw})")
    return stmts + slot_copies(e)


def _attention_grad(e: Emit) -> list[str]:
    stmts: list[str] = []
    kw, causal = _args(e, 6, stmts)
    args = ", ".join(e.ins[:6])
    fn = "flash_attention_grad" if _fused(e) else "attention_grad_math"
    stmts.append(f"{', '.join(e.outs)} = {fn}({args}, {causal}, {kw})")
    return stmts + slot_copies(e)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last axis, which ATen's CPU flash kernels assume
    without checking (a channels-last [B, H, L, E] tensor gives garbage)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    *,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse from ATen's fused CPU kernel."""
    out, lse = _flash.default(
        _rows(q), _rows(k), _rows(v), 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return out, lse


def flash_attention_grad(
    gout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    *,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gq, gk, gv from ATen's fused CPU backward kernel."""
    tensors = (_rows(t) for t in (gout, q, k, v, out))
    gq, gk, gv = _flash_backward.default(
        *tensors, lse, 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return gq, gk, gv


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.add_(mask)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_()
        s.masked_fill_(~keep, -math.inf)
    return s


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    *,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of attention as matmuls and a softmax (the op's semantics exactly)."""
    s = _scores(q, k, attn_mask, scale, causal)
    top = s.amax(-1, keepdim=True)
    top.masked_fill_(top == -math.inf, 0.0)  # a query that sees no key: out 0, lse 0
    e = s.sub_(top).exp_()
    total = e.sum(-1, keepdim=True)
    total.masked_fill_(total == 0, 1.0)
    out = torch.matmul(e.div_(total), v)
    return out, total.log_().add_(top).squeeze(-1)


def attention_grad_math(
    gout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    *,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gq, gk, gv of attention from the saved lse (the op's backward exactly)."""
    p = _scores(q, k, attn_mask, scale, causal).sub_(lse.unsqueeze(-1)).exp_()
    gv = torch.matmul(p.transpose(-1, -2), gout)
    delta = (gout * out).sum(-1, keepdim=True)
    ds = torch.matmul(gout, v.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), gv


KERNELS: dict[str, Emitter] = {
    "attention": _attention,
    "attention_grad": _attention_grad,
}

NAMESPACE: dict[str, Any] = {
    "flash_attention": flash_attention,
    "flash_attention_grad": flash_attention_grad,
    "attention_math": attention_math,
    "attention_grad_math": attention_grad_math,
}
