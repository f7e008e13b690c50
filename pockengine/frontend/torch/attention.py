"""ATen converter of ``scaled_dot_product_attention``, which the torch frontend keeps
whole (rather than torch.export's decomposition into matmuls and a softmax).

Without dropout, on [B, H, L, E] operands, it becomes the IR's ``attention`` op: the
backward then recomputes the probabilities from the saved log-sum-exp instead of
storing them, and the torch backend runs both as fused flash-attention kernels. With
dropout on the probabilities, or operands of another rank, it becomes the explicit
math (matmul, safe_softmax, dropout, matmul), as torch.export would have decomposed it.
"""

from __future__ import annotations

import math

from pockengine.frontend.torch.converters import Ctx, aten
from pockengine.ir import CompileError, DType, Value
from pockengine.ops.attention import attention_scores

__all__: list[str] = []


@aten("scaled_dot_product_attention.default")
def _sdpa(
    cx: Ctx,
    q: Value,
    k: Value,
    v: Value,
    attn_mask: Value | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Value:
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_float):
        raise CompileError(f"attention needs q, k, v of one float dtype, got {q}, {k}, {v}")
    if q.type.rank < 2 or k.type.rank != q.type.rank or v.type.rank != q.type.rank:
        raise CompileError(f"attention needs q, k, v of one rank >= 2, got {q}, {k}, {v}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if enable_gqa and q.type.rank >= 3 and k.shape[-3] != q.shape[-3]:
        k, v = _repeat_heads(cx, k, q.shape[-3]), _repeat_heads(cx, v, q.shape[-3])
    k, v = _broadcast_lead(cx, k, q), _broadcast_lead(cx, v, q)
    masks = [] if attn_mask is None else [_additive(cx, attn_mask, q.dtype)]
    if q.type.rank == 4 and not dropout_p:
        out, _ = cx.call_multi("attention", q, k, v, *masks, scale=scale, causal=bool(is_causal))
        return out
    return _explicit(cx, q, k, v, masks, scale, bool(is_causal), float(dropout_p))


def _additive(cx: Ctx, mask: Value, dtype: DType) -> Value:
    """A boolean mask (True: attend) as 0 / -inf; a float mask in the operands' dtype."""
    if mask.dtype is DType.BOOL:
        return cx.call("where", mask, cx.full(0.0, dtype), cx.full(-math.inf, dtype))
    return cx.cast(mask, dtype)


def _broadcast_lead(cx: Ctx, x: Value, q: Value) -> Value:
    """k or v with q's batch and head dims, as SDPA broadcasts them (Falcon's multi-query
    attention passes one shared key/value head as [B, 1, S, E])."""
    lead = q.shape[:-2]
    if x.shape[:-2] == lead:
        return x
    if any(d not in (1, want) for d, want in zip(x.shape[:-2], lead, strict=True)):
        raise CompileError(f"attention: {x.type} does not broadcast to the query's {q.type}")
    return cx.call("broadcast_to", x, shape=(*lead, *x.shape[-2:]))


def _repeat_heads(cx: Ctx, x: Value, heads: int) -> Value:
    """[..., Hk, S, E] -> [..., heads, S, E], each head repeated heads/Hk times in a row."""
    *lead, hk, s, e = x.shape
    if heads % hk:
        raise CompileError(f"attention: {heads} query heads are no multiple of {hk} kv heads")
    x = cx.call("reshape", x, shape=(*lead, hk, 1, s, e))
    x = cx.call("broadcast_to", x, shape=(*lead, hk, heads // hk, s, e))
    return cx.call("reshape", x, shape=(*lead, heads, s, e))


def _explicit(
    cx: Ctx,
    q: Value,
    k: Value,
    v: Value,
    masks: list[Value],
    scale: float,
    causal: bool,
    dropout_p: float,
) -> Value:
    s = attention_scores(cx.call, q, k, masks, cx.full(scale, q.dtype), causal)
    p = cx.call("safe_softmax", s, axis=-1)
    if dropout_p >= 1:
        p = cx.full(0.0, q.dtype, p.shape)
    elif dropout_p > 0:
        p = cx.dropout(p, dropout_p)[0]
    return cx.call("matmul", p, v)
