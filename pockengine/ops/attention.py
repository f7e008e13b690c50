"""Scaled dot-product attention as one op, and its backward kernel.

``attention`` keeps the [B, H, L, S] matrix of scores out of the graph: it returns the
output and the log-sum-exp of each query's scores (``lse``), and ``attention_grad``
recomputes the probabilities from q, k and lse when the backward needs them, as
FlashAttention's backward does. A training step then stores q, k, v, the output and
lse per layer instead of the probabilities (and the mask they were made with), and
the torch backend runs each as one fused ATen kernel.

Semantics are those of ``torch.nn.functional.scaled_dot_product_attention`` without
dropout: an additive float mask that broadcasts to [B, H, L, S], an optional causal
mask (query i sees keys j <= i, aligned at the top left as in PyTorch), and a query
whose keys are all masked out (-inf) gets a zero output and lse 0 instead of NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._common import broadcast_shapes

__all__ = ["attention_scores", "swap_last"]

Call = Callable[..., Value]  # emits one IR node: call(op, *inputs, **attrs)


def _check(
    op: str, q: TensorType, k: TensorType, v: TensorType, masks: Sequence[TensorType]
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.rank != 4:
            raise ShapeError(f"{op}: {name} must be [batch, heads, length, dim], got {t}")
        if t.dtype != q.dtype or not q.dtype.is_float:
            raise ShapeError(f"{op}: q, k and v need one float dtype, got {q}, {k}, {v}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ShapeError(f"{op}: q, k and v need the same batch and heads, got {q}, {k}, {v}")
    if k.shape[3] != q.shape[3] or v.shape[2] != k.shape[2]:
        raise ShapeError(f"{op}: q, k need one head size and k, v one length: {q}, {k}, {v}")
    if len(masks) > 1:
        raise ShapeError(f"{op}: at most one mask, got {len(masks)}")
    for m in masks:
        full = (*q.shape[:3], k.shape[2])
        if m.dtype != q.dtype or m.rank > 4 or broadcast_shapes(m.shape, full) != full:
            raise ShapeError(
                f"{op}: the mask must be additive ({q.dtype}) and broadcast to {full}, got {m}"
            )


def _check_attrs(op: str, scale: object, causal: object) -> None:
    if not isinstance(scale, float | int) or isinstance(scale, bool):
        raise ShapeError(f"{op}: scale must be a number, got {scale!r}")
    if not isinstance(causal, bool):
        raise ShapeError(f"{op}: causal must be a bool, got {causal!r}")


def _scores(q: Array, k: Array, masks: Sequence[Array], scale: float, causal: bool) -> Array:
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    for m in masks:
        s = s + m
    if causal:
        length, keys = s.shape[-2:]
        s = np.where(np.tri(length, keys, dtype=bool), s, -np.inf)
    return np.asarray(s)


def _attention_flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
    q, k, v = ins[:3]
    pairs = q.numel // q.shape[3] * k.shape[2]  # B * H * L * S
    return 2 * pairs * (q.shape[3] + v.shape[3]) + 5 * pairs  # two products and a softmax


@defop("attention")
class Attention:
    """Scaled dot-product attention of q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev] and
    an optional additive mask broadcasting to [B, H, L, S]; results out [B, H, L, Ev] and
    lse [B, H, L].

    Forward: s = q @ k^T * scale + mask (and -inf above the diagonal if causal);
    lse = logsumexp(s, -1); out = exp(s - lse) @ v. A row of -inf scores gives out 0, lse 0.
    Backward: (gq, gk, gv) = attention_grad(gout, q, k, v, out, lse, mask); a cotangent of
    lse or a mask that needs a gradient differentiates the scores in IR ops instead.
    """

    flops = staticmethod(_attention_flops)

    @staticmethod
    def infer(
        q: TensorType, k: TensorType, v: TensorType, *mask: TensorType, scale: float, causal: bool
    ) -> tuple[TensorType, TensorType]:
        _check("attention", q, k, v, mask)
        _check_attrs("attention", scale, causal)
        return TensorType((*q.shape[:3], v.shape[3]), q.dtype), TensorType(q.shape[:3], q.dtype)

    @staticmethod
    def kernel(
        q: Array, k: Array, v: Array, *mask: Array, scale: float, causal: bool
    ) -> tuple[Array, Array]:
        s = _scores(q, k, mask, scale, causal)
        top = np.max(s, axis=-1, keepdims=True)
        dead = np.isneginf(top)  # every key masked out
        top = np.where(dead, 0, top)
        e = np.exp(s - top)
        total = np.where(dead, 1, np.sum(e, axis=-1, keepdims=True))
        out = np.matmul(e / total, v)
        lse = np.where(dead, 0, top + np.log(total))[..., 0]
        return np.asarray(out, dtype=q.dtype), np.asarray(lse, dtype=q.dtype)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        q, k, v, *mask = c.inputs
        gout, glse = c.cts
        attrs = {"scale": c.attrs["scale"], "causal": c.attrs["causal"]}
        if glse is not None or (mask and c.needs[3]):
            return _explicit_vjp(c)
        if gout is None:
            return (None,) * len(c.inputs)
        out, lse = c.node.outputs
        grads = c.call_multi("attention_grad", gout, q, k, v, out, lse, *mask, **attrs)
        return (
            *(g if need else None for g, need in zip(grads, c.needs, strict=False)),
            *([None] * len(mask)),
        )

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
        mask = np.zeros((2, 1, 1, 5))
        mask[1, ..., 3:] = -np.inf  # a padded sequence
        dead = np.zeros((2, 1, 5, 5))
        dead[0, 0, 2, :] = -np.inf  # one query that sees no key
        bias = rng.standard_normal((5, 5))  # a learned bias: the mask needs a gradient
        cross = (rng.standard_normal((2, 3, 4, 4)), k, rng.standard_normal((2, 3, 5, 6)))
        return [
            Sample((q, k, v), {"scale": 0.5, "causal": False}),
            Sample((q, k, v, mask), {"scale": 0.5, "causal": False}),
            Sample((q, k, v, dead), {"scale": 0.3, "causal": True}),
            Sample((q, k, v, bias), {"scale": 0.5, "causal": False}),
            Sample(cross, {"scale": 0.5, "causal": True}),
        ]


def _explicit_vjp(c: VJPContext) -> tuple[Value | None, ...]:
    """The VJP through the scores in IR ops: for a mask that needs a gradient (a learned
    bias) or a cotangent of lse. Materialises the [B, H, L, S] probabilities."""
    q, k, v, *mask = c.inputs
    gout, glse = c.cts
    out, lse = c.node.outputs
    scale, causal = c.attrs["scale"], bool(c.attrs["causal"])
    assert isinstance(scale, float | int)
    s = attention_scores(c.call, q, k, mask, c.const(scale, q), causal)
    p = c.call("exp", c.call("sub", s, c.call("reshape", lse, shape=(*lse.shape, 1))))
    ds: Value | None = None
    gv: Value | None = None
    if gout is not None:
        dp = c.call("matmul", gout, swap_last(c.call, v))
        delta = c.call("sum", c.call("mul", gout, out), axes=(3,), keepdims=True)
        ds = c.call("mul", p, c.call("sub", dp, delta))
        gv = c.call("matmul", swap_last(c.call, p), gout) if c.needs[2] else None
    if glse is not None:
        from_lse = c.call("mul", p, c.call("reshape", glse, shape=(*glse.shape, 1)))
        ds = from_lse if ds is None else c.call("add", ds, from_lse)
    assert ds is not None  # one of gout, glse is given
    gs = c.call("mul", ds, c.const(scale, q))
    gq = c.call("matmul", gs, k) if c.needs[0] else None
    gk = c.call("matmul", swap_last(c.call, gs), q) if c.needs[1] else None
    gmask = [ds if need else None for need in c.needs[3:]]
    return (gq, gk, gv, *gmask)


def swap_last(call: Call, x: Value) -> Value:
    """x with its last two axes swapped, emitted through ``call``."""
    r = x.type.rank
    return call("transpose", x, perm=(*range(r - 2), r - 1, r - 2))


def attention_scores(
    call: Call, q: Value, k: Value, masks: Sequence[Value], scale: Value, causal: bool
) -> Value:
    """The scores q @ k^T * scale + each mask, with -inf where key j > query i if causal,
    as IR nodes emitted through ``call`` (a VJP context's or a frontend converter's)."""
    s = call("mul", call("matmul", q, swap_last(call, k)), scale)
    for m in masks:
        s = call("add", s, m)
    if not causal:
        return s
    length, keys = s.shape[-2:]
    rows = call("arange", start=0, stop=length, step=1, dtype="i64")
    cols = call("arange", start=0, stop=keys, step=1, dtype="i64")
    keep = call("ge", call("reshape", rows, shape=(length, 1)), cols)
    return call("where", keep, s, call("full", shape=(), value=-np.inf, dtype=str(s.dtype)))


@defop("attention_grad")
class AttentionGrad:
    """Backward kernel of attention (FlashAttention's): from gout, q, k, v, out, lse and
    the mask, recompute p = exp(s - lse); gv = p^T @ gout; ds = p * (gout @ v^T -
    rowsum(gout * out)); gq = ds @ k * scale; gk = ds^T @ q * scale."""

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        q, k, v = ins[1:4]
        pairs = q.numel // q.shape[3] * k.shape[2]
        return 2 * pairs * (3 * q.shape[3] + 2 * v.shape[3]) + 6 * pairs

    @staticmethod
    def infer(
        gout: TensorType,
        q: TensorType,
        k: TensorType,
        v: TensorType,
        out: TensorType,
        lse: TensorType,
        *mask: TensorType,
        scale: float,
        causal: bool,
    ) -> tuple[TensorType, ...]:
        _check("attention_grad", q, k, v, mask)
        _check_attrs("attention_grad", scale, causal)
        want = TensorType((*q.shape[:3], v.shape[3]), q.dtype)
        if gout != want or out != want or lse != TensorType(q.shape[:3], q.dtype):
            raise ShapeError(f"attention_grad: gout and out must be {want}, lse {q.shape[:3]}")
        return q, k, v

    @staticmethod
    def kernel(
        gout: Array,
        q: Array,
        k: Array,
        v: Array,
        out: Array,
        lse: Array,
        *mask: Array,
        scale: float,
        causal: bool,
    ) -> tuple[Array, Array, Array]:
        p = np.exp(_scores(q, k, mask, scale, causal) - lse[..., None])
        gv = np.matmul(np.swapaxes(p, -1, -2), gout)
        delta = np.sum(gout * out, axis=-1, keepdims=True)
        ds = p * (np.matmul(gout, np.swapaxes(v, -1, -2)) - delta) * q.dtype.type(scale)
        gq = np.matmul(ds, k)
        gk = np.matmul(np.swapaxes(ds, -1, -2), q)
        return tuple(np.asarray(g, dtype=q.dtype) for g in (gq, gk, gv))  # type: ignore[return-value]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in Attention.samples(rng)[1:3]:
            attrs = sample.attrs
            o, lse = Attention.kernel(*sample.inputs, scale=attrs["scale"], causal=attrs["causal"])
            q, k, v, *mask = sample.inputs
            gout = np.asarray(rng.standard_normal(o.shape))
            out.append(Sample((gout, q, k, v, o, lse, *mask), attrs))
        return out
