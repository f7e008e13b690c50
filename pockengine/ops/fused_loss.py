"""The final linear layer, log-softmax and target gather of a large-vocabulary loss, as
one op chunked over rows, and its backward kernel.

A language model's loss reads ``gather(log_softmax(x @ w + b), target)``: one
log-probability per token, out of ``[tokens, vocab]`` logits. Unfused, the logits, the
log-probabilities and, in the backward, their gradient each exist whole (three float32
``[tokens, vocab]`` tensors; 100 MB each for SmolLM2 at 512 tokens), and the
log-probabilities are saved from the forward to the backward.
``linear_log_softmax_gather`` computes ``chunk`` rows at a time and keeps only what the
backward needs: one log-sum-exp per row. ``linear_log_softmax_gather_grad`` recomputes
each chunk's logits from ``x``, ``w`` and ``lse`` (one more matmul, as FlashAttention's
backward recomputes its scores), so the peak extra memory is about ``chunk x vocab``
elements in both directions.

``passes.fuse_loss`` rewrites the frontends' pattern into these ops; the ignore-index
guard, the negation and the mean around the gather stay as they were.

``linear_log_softmax_gather_with_grad`` is both at once: each chunk's logits are made
once, and its log-sum-exp, picked values and gradients come from them. The training
graph uses it where the cotangents (``gp``, ``scale``) do not depend on the op's own
outputs -- a mean or sum of the picked log-probabilities, masked or not, whose gradient
is known before the loss is -- so the backward's recomputed matmul goes
(``passes.fuse_loss.fuse_loss_backward``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pockengine.ir import DType, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array

__all__ = ["chunks", "grad_outputs", "vocab_of"]

_INDEX_DTYPES = (DType.I64, DType.I32)


def chunks(rows: int, chunk: int) -> Iterator[slice]:
    """The row ranges of the chunks, in order."""
    for start in range(0, rows, chunk):
        yield slice(start, min(rows, start + chunk))


def vocab_of(w: TensorType, vocab_major: bool) -> int:
    """The vocabulary size of a weight laid out [vocab, k] (vocab_major) or [k, vocab]."""
    return w.shape[0] if vocab_major else w.shape[1]


def _check(
    op: str,
    x: TensorType,
    w: TensorType,
    index: TensorType,
    bias: Sequence[TensorType],
    vocab_major: bool,
) -> None:
    if not isinstance(vocab_major, bool):
        raise ShapeError(f"{op}: vocab_major must be a bool, got {vocab_major!r}")
    width = w.shape[1] if vocab_major else w.shape[0] if w.rank == 2 else -1
    if x.rank != 2 or w.rank != 2 or x.shape[1] != width:
        layout = "[vocab, k]" if vocab_major else "[k, vocab]"
        raise ShapeError(f"{op} needs x [rows, k] and w {layout}, got {x}, {w}")
    if not x.dtype.is_float or w.dtype != x.dtype:
        raise ShapeError(f"{op} needs x and w of one float dtype, got {x}, {w}")
    if index.dtype not in _INDEX_DTYPES or index.shape != (x.shape[0],):
        raise ShapeError(f"{op} needs an i64 or i32 index [{x.shape[0]}], got {index}")
    vocab = vocab_of(w, vocab_major)
    if len(bias) > 1 or any(b != TensorType((vocab,), x.dtype) for b in bias):
        raise ShapeError(f"{op} takes at most one bias [{vocab}] of x's dtype, got {bias}")


def grad_outputs(
    op: str,
    x: TensorType,
    w: TensorType,
    bias: Sequence[TensorType],
    x_grad: bool,
    w_grad: bool,
    b_grad: bool,
) -> tuple[TensorType, ...]:
    """The types of the gradients ``x_grad``, ``w_grad``, ``b_grad`` ask for, in that order."""
    if b_grad and not bias:
        raise ShapeError(f"{op}: b_grad without a bias")
    wanted = ((x_grad, x), (w_grad, w), (b_grad, bias[0] if bias else x))
    return tuple(t for want, t in wanted if want)


def _run_chunks(
    x: Array,
    w: Array,
    index: Array,
    bias: Sequence[Array],
    chunk: int,
    vocab_major: bool,
    lse: Array | None = None,
    cotangents: tuple[Array, Array] | None = None,
    wanted: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[Array, Array, tuple[Array, ...]]:
    """The chunk loop of all three kernels: picked and lse (lse computed unless given),
    and with ``cotangents`` (gp, scale) the ``wanted`` ones of gx, gw, gb of dz = scale *
    exp(z - lse) + gp * onehot(index), each chunk's logits made once."""
    picked = np.empty(x.shape[0], dtype=x.dtype)
    given = lse is not None
    lse = lse if lse is not None else np.empty(x.shape[0], dtype=x.dtype)
    gx, gw = np.zeros_like(x), np.zeros_like(w)
    gb = np.zeros(w.shape[0] if vocab_major else w.shape[1], dtype=x.dtype)
    for rows in chunks(x.shape[0], chunk):
        z = _logits(x[rows], w, bias, vocab_major)
        if not given:
            lse[rows] = _logsumexp(z)
            picked[rows] = z[np.arange(z.shape[0]), index[rows]] - lse[rows]
        if cotangents is None:
            continue
        gp, scale = cotangents
        dz = np.exp(z - lse[rows, None]) * scale[rows, None]
        dz[np.arange(dz.shape[0]), index[rows]] += gp[rows]
        if wanted[0]:
            gx[rows] = dz @ (w if vocab_major else w.T)
        if wanted[1]:
            gw += dz.T @ x[rows] if vocab_major else x[rows].T @ dz
        if wanted[2]:
            gb += np.sum(dz, axis=0)
    return picked, lse, _kept(wanted, (gx, gw, gb), x.dtype)


def _kept(
    wanted: tuple[bool, bool, bool], grads: tuple[Array, Array, Array], dtype: Any
) -> tuple[Array, ...]:
    return tuple(np.asarray(g, dtype=dtype) for want, g in zip(wanted, grads, strict=True) if want)


def _check_chunk(op: str, chunk: object) -> int:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ShapeError(f"{op}: chunk must be a positive int (rows per chunk), got {chunk!r}")
    return chunk


def _logits(x: Array, w: Array, bias: Sequence[Array], vocab_major: bool) -> Array:
    z = np.matmul(x, w.T if vocab_major else w)
    return np.asarray(z + bias[0] if bias else z)


def _logsumexp(z: Array) -> Array:
    top = np.amax(z, axis=1)
    return np.asarray(top + np.log(np.sum(np.exp(z - top[:, None]), axis=1)))


def _gemm_flops(x: TensorType, w: TensorType) -> int:
    return 2 * x.numel * w.numel // x.shape[1]


def _grad_flops(x: TensorType, w: TensorType, attrs: Any, elementwise: int) -> int:
    """One logits product, one more per gradient product asked for, ``elementwise`` per
    logit."""
    grads = sum(bool(attrs[k]) for k in ("x_grad", "w_grad"))
    return (1 + grads) * _gemm_flops(x, w) + elementwise * x.shape[0] * w.numel // x.shape[1]


@defop("linear_log_softmax_gather")
class LinearLogSoftmaxGather:
    """Forward: z = x @ w (+ b) (x @ w^T with ``vocab_major``, w [vocab, k] as nn.Linear
    and a tied embedding hold it), lse_i = logsumexp(z_i), picked_i = z_i[index_i] - lse_i
    (= gather(log_softmax(z, 1), index[:, None], 1)[:, 0]), ``chunk`` rows at a time; returns
    picked and lse. Backward: dz = gp * onehot(index) + (glse - gp) * softmax(z), recomputed
    per chunk by ``linear_log_softmax_gather_grad``: gx = dz @ w^T, gw = x^T @ dz (dz^T @ x
    with ``vocab_major``), gb = sum(dz, 0)."""

    @staticmethod
    def infer(
        x: TensorType,
        w: TensorType,
        index: TensorType,
        *bias: TensorType,
        chunk: int,
        vocab_major: bool,
    ) -> tuple[TensorType, TensorType]:
        _check("linear_log_softmax_gather", x, w, index, bias, vocab_major)
        _check_chunk("linear_log_softmax_gather", chunk)
        rows = TensorType((x.shape[0],), x.dtype)
        return rows, rows

    @staticmethod
    def kernel(
        x: Array, w: Array, index: Array, *bias: Array, chunk: int, vocab_major: bool
    ) -> tuple[Array, Array]:
        picked, lse, _ = _run_chunks(x, w, index, bias, chunk, vocab_major)
        return picked, lse

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        x, w = ins[0], ins[1]
        return _gemm_flops(x, w) + (4 + (len(ins) > 3)) * x.shape[0] * w.numel // x.shape[1]

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w, index, *bias = c.inputs
        gp, glse = c.cts
        need_x, need_w = c.needs[0], c.needs[1]
        need_b = bool(bias) and c.needs[3]
        if not (need_x or need_w or need_b):
            return (None, None, None, *([None] * len(bias)))
        rows = (x.shape[0],)
        if gp is None:  # only lse has a cotangent: dz = glse * softmax(z)
            gp = c.call("broadcast_to", c.const(0.0, x), shape=rows)
        scale = c.call("neg", gp) if glse is None else c.call("sub", glse, gp)
        _, lse = c.node.outputs
        grads = iter(
            c.call_multi(
                "linear_log_softmax_gather_grad",
                gp,
                scale,
                x,
                w,
                index,
                lse,
                *bias,
                chunk=c.attrs["chunk"],
                vocab_major=c.attrs["vocab_major"],
                x_grad=need_x,
                w_grad=need_w,
                b_grad=need_b,
            )
        )
        gx = next(grads) if need_x else None
        gw = next(grads) if need_w else None
        gb = [next(grads) if need_b else None] if bias else []
        return (gx, gw, None, *gb)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x, w = rng.standard_normal((5, 3)), rng.standard_normal((3, 7))
        index, b = rng.integers(0, 7, 5), rng.standard_normal(7)
        return [
            Sample((x, w, index), {"chunk": 2, "vocab_major": False}),  # the last chunk short
            Sample((x, w, index, b), {"chunk": 5, "vocab_major": False}),
            Sample((x, w.T.copy(), index.astype(np.int32), b), {"chunk": 3, "vocab_major": True}),
        ]


@defop("linear_log_softmax_gather_grad")
class LinearLogSoftmaxGatherGrad:
    """Backward kernel of linear_log_softmax_gather: per chunk of rows, recompute
    p = exp(x @ w (+ b) - lse), dz = scale * p + gp * onehot(index), and accumulate
    gx = dz @ w^T, gw = x^T @ dz (dz^T @ x with ``vocab_major``), gb = sum(dz, 0);
    ``x_grad``, ``w_grad``, ``b_grad`` say which of them it returns, in that order (inputs:
    gp, scale, x, w, index, lse, [b])."""

    @staticmethod
    def infer(
        gp: TensorType,
        scale: TensorType,
        x: TensorType,
        w: TensorType,
        index: TensorType,
        lse: TensorType,
        *bias: TensorType,
        chunk: int,
        vocab_major: bool,
        x_grad: bool,
        w_grad: bool,
        b_grad: bool,
    ) -> tuple[TensorType, ...]:
        op = "linear_log_softmax_gather_grad"
        _check(op, x, w, index, bias, vocab_major)
        _check_chunk(op, chunk)
        rows = TensorType((x.shape[0],), x.dtype)
        if gp != rows or scale != rows or lse != rows:
            raise ShapeError(f"{op} needs gp, scale and lse of type {rows}: {gp}, {scale}, {lse}")
        return grad_outputs(op, x, w, bias, x_grad, w_grad, b_grad)

    @staticmethod
    def kernel(
        gp: Array,
        scale: Array,
        x: Array,
        w: Array,
        index: Array,
        lse: Array,
        *bias: Array,
        chunk: int,
        vocab_major: bool,
        x_grad: bool,
        w_grad: bool,
        b_grad: bool,
    ) -> tuple[Array, ...]:
        wanted = (x_grad, w_grad, b_grad)
        return _run_chunks(x, w, index, bias, chunk, vocab_major, lse, (gp, scale), wanted)[2]

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return _grad_flops(ins[2], ins[3], attrs, elementwise=4)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        flags = ({"x_grad": True, "w_grad": True, "b_grad": False},
                 {"x_grad": False, "w_grad": True, "b_grad": True},
                 {"x_grad": True, "w_grad": True, "b_grad": True})  # fmt: skip
        for sample, grads in zip(LinearLogSoftmaxGather.samples(rng), flags, strict=True):
            x, w, index, *bias = sample.inputs
            _, lse = LinearLogSoftmaxGather.kernel(*sample.inputs, **sample.attrs)
            gp, scale = rng.standard_normal(x.shape[0]), rng.standard_normal(x.shape[0])
            out.append(Sample((gp, scale, x, w, index, lse, *bias), {**sample.attrs, **grads}))
        return out


@defop("linear_log_softmax_gather_with_grad")
class LinearLogSoftmaxGatherWithGrad:
    """linear_log_softmax_gather and its backward kernel in one pass over the chunks,
    each chunk's logits made once: outputs picked, lse, then the gradients ``x_grad``,
    ``w_grad``, ``b_grad`` ask for, of dz = scale * softmax(z) + gp * onehot(index)
    (inputs: gp, scale, x, w, index, [b]). Only correct where gp and scale are known
    before the loss is: ``passes.fuse_loss.fuse_loss_backward`` checks that."""

    @staticmethod
    def infer(
        gp: TensorType,
        scale: TensorType,
        x: TensorType,
        w: TensorType,
        index: TensorType,
        *bias: TensorType,
        chunk: int,
        vocab_major: bool,
        x_grad: bool,
        w_grad: bool,
        b_grad: bool,
    ) -> tuple[TensorType, ...]:
        op = "linear_log_softmax_gather_with_grad"
        _check(op, x, w, index, bias, vocab_major)
        _check_chunk(op, chunk)
        rows = TensorType((x.shape[0],), x.dtype)
        if gp != rows or scale != rows:
            raise ShapeError(f"{op} needs gp and scale of type {rows}: {gp}, {scale}")
        return (rows, rows, *grad_outputs(op, x, w, bias, x_grad, w_grad, b_grad))

    @staticmethod
    def kernel(
        gp: Array,
        scale: Array,
        x: Array,
        w: Array,
        index: Array,
        *bias: Array,
        chunk: int,
        vocab_major: bool,
        x_grad: bool,
        w_grad: bool,
        b_grad: bool,
    ) -> tuple[Array, ...]:
        wanted = (x_grad, w_grad, b_grad)
        picked, lse, grads = _run_chunks(
            x, w, index, bias, chunk, vocab_major, cotangents=(gp, scale), wanted=wanted
        )
        return (picked, lse, *grads)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return _grad_flops(ins[2], ins[3], attrs, elementwise=8)  # the forward's 4 too

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in LinearLogSoftmaxGatherGrad.samples(rng):
            gp, scale, x, w, index, _, *bias = sample.inputs
            out.append(Sample((gp, scale, x, w, index, *bias), sample.attrs))
        return out
