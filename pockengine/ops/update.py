"""Effectful update ops: they write params, buffers or optimizer state in place.

They have no results. Each kernel returns the new values of the inputs it
writes, in the order of ``mutates``; a backend may instead write in place.
The learning rate and the step count are scalar graph values (state), so a
schedule changes them without recompiling.

Partial-channel updates: with ``rows=k`` an update writes only ``w[:k]`` (the first
k output channels); the gradient and the optimizer state then have k rows.

Skipped steps: every effect takes an optional last input ``skip``, an f32 scalar that is
1.0 when the step's loss is not finite (``nonfinite(loss)``, computed right after the
loss, before any update can run). With ``skip`` = 1 an effect writes back what it read,
so a step on a NaN batch changes no param, optimizer state, buffer or step count, as
``torch.amp.GradScaler`` skips a step with infs. f32 rather than bool because ATen's
fused optimizers take exactly this flag (``found_inf``) and skip inside the kernel.
"""

from __future__ import annotations

import numpy as np

from pockengine.ir import DType, Sample, ShapeError, TensorType, defop
from pockengine.ir.arrays import Array

__all__: list[str] = []

_ONE = np.asarray(1.0, dtype=np.float32)  # sample skip flags
_ZERO = np.asarray(0.0, dtype=np.float32)


def _same(op: str, *types: TensorType) -> None:
    if len({(t.shape, t.dtype) for t in types}) != 1:
        raise ShapeError(f"{op} needs equal types, got {[str(t) for t in types]}")


def _trained(op: str, w: TensorType, rows: int | None, *per_row: TensorType) -> None:
    """The gradient and state match ``w``, or its first ``rows`` rows."""
    want = w if rows is None else TensorType((rows, *w.shape[1:]), w.dtype)
    if rows is not None and not (w.rank >= 1 and 0 < rows <= w.shape[0]):
        raise ShapeError(f"{op}: rows={rows} does not fit {w}")
    _same(op, want, *per_row)


def _write_rows(w: Array, rows: int | None, new: Array) -> Array:
    if rows is None:
        return new.astype(w.dtype)
    out = w.copy()
    out[:rows] = new
    return out


def _scalar(op: str, t: TensorType) -> None:
    if t.shape != ():
        raise ShapeError(f"{op} needs a scalar, got {t}")


def _update_flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
    return 4 * ins[0].numel


def _skip_flag(op: str, skip: TensorType | None) -> None:
    """The optional ``skip`` input: an f32 scalar."""
    if skip is not None and (skip.shape != () or skip.dtype is not DType.F32):
        raise ShapeError(f"{op}: skip must be an f32 scalar, got {skip}")


def _skipped(skip: Array | None) -> bool:
    return skip is not None and bool(np.asarray(skip) != 0)


def _unchanged(*written: Array) -> tuple[Array, ...]:
    """What a skipped effect writes back: copies of what it read."""
    return tuple(np.array(a, copy=True) for a in written)


def _adam_signature(
    op: str,
    w: TensorType,
    g: TensorType,
    rows: int | None,
    t: TensorType,
    lr: TensorType,
    skip: TensorType | None,
    *per_row: TensorType,
) -> None:
    """The checks every AdamW variant shares: the gradient (and ``per_row`` state) fits
    ``w`` or its first ``rows`` rows; scalar step count and rate; the skip flag."""
    _trained(op, w, rows, g, *per_row)
    _scalar(op, t)
    _scalar(op, lr)
    _skip_flag(op, skip)


def _adamw_math(
    w: Array,
    g: Array,
    m: Array,
    v: Array,
    t: Array | float,
    lr: Array | float,
    rows: int | None,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[Array, Array, Array, Array]:
    """One AdamW step on ``w`` (its first ``rows`` rows) from float moments: the new
    trained part, ``m``, ``v`` and ``sqrt(v)`` (``adamw_update``'s docstring)."""
    part = (w if rows is None else w[:rows]) * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    root = np.sqrt(v)
    denom = root / np.sqrt(1 - beta2**t) + eps
    return part - (lr / (1 - beta1**t)) * m / denom, m, v, root


@defop("nonfinite")
class NonFinite:
    """Forward: skip = 1.0 if any element of x is NaN or +-inf, else 0.0 (an f32 scalar,
    ATen's ``found_inf``). The step's updates take it as their ``skip`` input. No
    gradient: it is computed from the loss after autodiff has run."""

    @staticmethod
    def infer(x: TensorType) -> tuple[TensorType, ...]:
        if not x.dtype.is_float:
            raise ShapeError(f"nonfinite needs a floating tensor, got {x}")
        return (TensorType((), DType.F32),)

    @staticmethod
    def kernel(x: Array) -> tuple[Array]:
        return (np.asarray(0.0 if np.isfinite(x).all() else 1.0, dtype=np.float32),)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return ins[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal(3),)),
            Sample((np.array([1.0, np.nan]),)),
            Sample((np.asarray(np.inf),)),
        ]


@defop("assign", mutates=(0,))
class Assign:
    """Effect: dst <- src (a buffer's new running statistic, the next step count)."""

    @staticmethod
    def infer(
        dst: TensorType, src: TensorType, skip: TensorType | None = None
    ) -> tuple[TensorType, ...]:
        _same("assign", dst, src)
        _skip_flag("assign", skip)
        return ()

    @staticmethod
    def kernel(dst: Array, src: Array, skip: Array | None = None) -> tuple[Array, ...]:
        if _skipped(skip):
            return _unchanged(dst)
        return (np.array(src, dtype=dst.dtype, copy=True),)

    @staticmethod
    def flops(ins: object, outs: object, attrs: object) -> int:
        return 0

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        dst, src = rng.standard_normal(3), rng.standard_normal(3)
        return [
            Sample((dst, src)),
            Sample((dst, src, np.asarray(1.0, dtype=np.float32))),
            Sample((dst, src, np.asarray(0.0, dtype=np.float32))),
        ]


def _sgd_direction(w: Array, g: Array, weight_decay: float) -> Array:
    return g + weight_decay * w if weight_decay else g


@defop("sgd_update", mutates=(0,))
class SGDUpdate:
    """Effect: w <- w - lr * (g + weight_decay * w)."""

    flops = staticmethod(_update_flops)

    @staticmethod
    def infer(
        w: TensorType,
        g: TensorType,
        lr: TensorType,
        skip: TensorType | None = None,
        *,
        weight_decay: float,
        rows: int | None = None,
    ) -> tuple[TensorType, ...]:
        _trained("sgd_update", w, rows, g)
        _scalar("sgd_update", lr)
        _skip_flag("sgd_update", skip)
        return ()

    @staticmethod
    def kernel(
        w: Array,
        g: Array,
        lr: Array,
        skip: Array | None = None,
        *,
        weight_decay: float,
        rows: int | None = None,
    ) -> tuple[Array, ...]:
        if _skipped(skip):
            return _unchanged(w)
        part = w if rows is None else w[:rows]
        d = _sgd_direction(part, g, weight_decay)
        return (_write_rows(w, rows, part - lr * d),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        w, g = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
        part = rng.standard_normal((1, 3))
        return [
            Sample((w, g, np.asarray(0.1)), {"weight_decay": 0.01}),
            Sample((w, part, np.asarray(0.1)), {"weight_decay": 0.01, "rows": 1}),
            Sample((w, g, np.asarray(0.1), _ONE), {"weight_decay": 0.01}),
            Sample((w, g, np.asarray(0.1), _ZERO), {"weight_decay": 0.01}),
        ]


@defop("sgd_momentum_update", mutates=(0, 2))
class SGDMomentumUpdate:
    """Effect, as torch.optim.SGD with dampening 0 (a zero buffer makes step 1 buf = d):
    d = g + weight_decay * w; buf <- momentum * buf + d;
    w <- w - lr * (d + momentum * buf if nesterov else buf)."""

    flops = staticmethod(_update_flops)

    @staticmethod
    def infer(
        w: TensorType,
        g: TensorType,
        buf: TensorType,
        lr: TensorType,
        skip: TensorType | None = None,
        *,
        momentum: float,
        weight_decay: float,
        nesterov: bool,
        rows: int | None = None,
    ) -> tuple[TensorType, ...]:
        _trained("sgd_momentum_update", w, rows, g, buf)
        _scalar("sgd_momentum_update", lr)
        _skip_flag("sgd_momentum_update", skip)
        return ()

    @staticmethod
    def kernel(
        w: Array,
        g: Array,
        buf: Array,
        lr: Array,
        skip: Array | None = None,
        *,
        momentum: float,
        weight_decay: float,
        nesterov: bool,
        rows: int | None = None,
    ) -> tuple[Array, ...]:
        if _skipped(skip):
            return _unchanged(w, buf)
        part = w if rows is None else w[:rows]
        d = _sgd_direction(part, g, weight_decay)
        new_buf = (momentum * buf + d).astype(buf.dtype)
        step = d + momentum * new_buf if nesterov else new_buf
        return _write_rows(w, rows, part - lr * step), new_buf

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        w, g, m = (rng.standard_normal((4,)) for _ in range(3))
        attrs = {"momentum": 0.9, "weight_decay": 0.0, "nesterov": True}
        w2, g2, m2 = rng.standard_normal((4, 2)), rng.standard_normal((3, 2)), np.zeros((3, 2))
        return [
            Sample((w, g, m, np.asarray(0.1)), attrs),
            Sample((w2, g2, m2, np.asarray(0.1)), {**attrs, "rows": 3}),
            Sample((w, g, m, np.asarray(0.1), _ONE), attrs),
        ]


@defop("adamw_update", mutates=(0, 2, 3))
class AdamWUpdate:
    """Effect, as torch.optim.AdamW (step t is the count after this step, t >= 1):
    w <- w * (1 - lr * weight_decay); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""

    @staticmethod
    def infer(
        w: TensorType,
        g: TensorType,
        m: TensorType,
        v: TensorType,
        t: TensorType,
        lr: TensorType,
        skip: TensorType | None = None,
        *,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        rows: int | None = None,
    ) -> tuple[TensorType, ...]:
        _adam_signature("adamw_update", w, g, rows, t, lr, skip, m, v)
        return ()

    @staticmethod
    def kernel(
        w: Array,
        g: Array,
        m: Array,
        v: Array,
        t: Array,
        lr: Array,
        skip: Array | None = None,
        *,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        rows: int | None = None,
    ) -> tuple[Array, ...]:
        if _skipped(skip):
            return _unchanged(w, m, v)
        part, m, v, _ = _adamw_math(
            w, g, m, v, t, lr, rows, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay
        )
        return _write_rows(w, rows, part), m.astype(w.dtype), v.astype(w.dtype)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        return 12 * ins[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        w, g, m = (rng.standard_normal((3,)) for _ in range(3))
        v = rng.random(3)
        attrs = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
        return [
            Sample((w, g, m, v, np.asarray(2.0), np.asarray(1e-3)), attrs),
            Sample((w, g, m, v, np.asarray(2.0), np.asarray(1e-3), _ONE), attrs),
            Sample((w, g, m, v, np.asarray(2.0), np.asarray(1e-3), _ZERO), attrs),
        ]
