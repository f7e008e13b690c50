"""The torch kernel table: float optimizer updates (``sgd_update``, ``sgd_momentum_update``,
``adamw_update``), written in place.

Each update writes the param and its optimizer state in one pass where it can: ATen's
fused SGD and AdamW kernels, so the tensors in the store keep their storage from step to
step. Those kernels split every tensor over the intra-op threads whatever its size (their
``parallel_for`` has no grain), so with two or more threads each update of a bias or a
norm's scale is an OpenMP region that waits for every thread: on a busy machine, for a
thread the OS has descheduled, milliseconds per region where the update itself takes
microseconds (BERT's sparse step, 2 threads: 76 such regions). Params of fewer than
``SERIAL_NUMEL`` trained elements (ATen's grain: its elementwise kernels run smaller tensors
on the calling thread) are therefore updated with ``*_small_``: while more than one thread
is set, the same arithmetic as a few in-place elementwise ops, the way ``torch.optim``'s
single-tensor path runs them; with one thread, the fused kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal
from pockengine.ir import DType

__all__ = [
    "KERNELS",
    "NAMESPACE",
    "SERIAL_NUMEL",
    "adamw_small_",
    "sgd_momentum_small_",
]

# ATen's at::internal::GRAIN_SIZE: elementwise kernels run tensors this small on one thread.
SERIAL_NUMEL = 32768
# dtypes whose elementwise ops round like the fused kernels' float arithmetic
_SERIAL_DTYPES = (DType.F32, DType.F64)


def _trained_part(e: Emit, stmts: list[str]) -> str:
    """The param, or the view of its first ``rows`` rows that a partial update writes."""
    rows = e.get("rows")
    if rows is None:
        return e.ins[0]
    part = e.tmp()
    stmts.append(f"{part} = {e.ins[0]}.narrow(0, 0, {int(rows)})")
    return part


def _small(e: Emit) -> bool:
    """Whether the update goes to a ``*_small_`` kernel: a float32/64 CPU param with fewer
    than ``SERIAL_NUMEL`` trained elements (the gradient's)."""
    g = e.node.inputs[1]
    return e.device.type == "cpu" and g.dtype in _SERIAL_DTYPES and g.type.numel < SERIAL_NUMEL


def _direction(e: Emit, w: str, g: str, stmts: list[str]) -> str:
    """d = g + weight_decay * w."""
    decay = float(e.attr("weight_decay"))
    if not decay:
        return g
    d = e.tmp()
    stmts.append(f"{d} = aten_add({g}, {w}, alpha={literal(decay)})")
    return d


def _skip(e: Emit, position: int) -> str:
    """The optional ``skip`` flag (1.0: a non-finite step, write nothing) as the fused
    kernels' ``found_inf`` argument, or nothing."""
    return f", found_inf={e.ins[position]}" if len(e.ins) > position else ""


def _flag(e: Emit, position: int) -> str:
    """The optional ``skip`` flag as a positional argument (``None`` without one)."""
    return e.ins[position] if len(e.ins) > position else "None"


def _laid_out_as(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g`` with the strides of ``w`` (a dense param): the fused kernels index raw memory."""
    return g if g.stride() == w.stride() else torch.empty_like(w).copy_(g)


def _skipped(skip: torch.Tensor | None) -> bool:
    return skip is not None and bool(skip.item())


def adamw_small_(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor,
    lr: torch.Tensor,
    skip: torch.Tensor | None,
    hyper: tuple[float, float, float, float],
) -> None:
    """``adamw_update`` of a small CPU param in place, on the calling thread while more than
    one intra-op thread is set (ATen's fused kernel otherwise). ``hyper``: beta1, beta2,
    eps, weight_decay."""
    beta1, beta2, eps, weight_decay = hyper
    if torch.get_num_threads() == 1:
        torch._fused_adamw_(
            [w], [_laid_out_as(g, w)], [m], [v], [], [t], lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=skip,
        )  # fmt: skip
        return
    if _skipped(skip):
        return
    step, rate = float(t.item()), float(lr.item())
    if weight_decay:
        w.mul_(1.0 - rate * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = v.sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(eps)
    w.addcdiv_(m, denom, value=-rate / (1.0 - beta1**step))


def sgd_momentum_small_(
    w: torch.Tensor,
    g: torch.Tensor,
    buf: torch.Tensor,
    lr: torch.Tensor,
    skip: torch.Tensor | None,
    hyper: tuple[float, float, bool],
) -> None:
    """``sgd_momentum_update`` of a small CPU param in place, on the calling thread while more
    than one intra-op thread is set (ATen's fused kernel otherwise). ``hyper``: momentum,
    weight_decay, nesterov."""
    momentum, weight_decay, nesterov = hyper
    if torch.get_num_threads() == 1:
        torch._fused_sgd_(
            [w], [_laid_out_as(g, w)], [buf], weight_decay=weight_decay, momentum=momentum,
            lr=lr, dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=False,
            found_inf=skip,
        )  # fmt: skip
        return
    if _skipped(skip):
        return
    d = torch.add(g, w, alpha=weight_decay) if weight_decay else g
    buf.mul_(momentum).add_(d)
    w.sub_(torch.add(d, buf, alpha=momentum) if nesterov else buf, alpha=float(lr.item()))


def _sgd_update(e: Emit) -> list[str]:
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, lr = e.ins[1], e.ins[2]
    if len(e.ins) > 3 and not _small(e):  # ATen's fused SGD without momentum skips on found_inf
        args = (
            f"[{w}], [laid_out_as({g}, {w})], []"
            f", weight_decay={literal(float(e.attr('weight_decay')))}, momentum=0.0, lr={lr}"
            ", dampening=0.0, nesterov=False, maximize=False, is_first_step=False"
        )
        return [*stmts, f"aten_fused_sgd_({args}{_skip(e, 3)})"]
    d = _direction(e, w, g, stmts)
    update = f"{w}.addcmul_({d}, {lr}, value=-1)"
    if len(e.ins) > 3:  # small: elementwise ops on this thread, unless the step is skipped
        update = f"{update} if not {e.ins[3]}.item() else None"
    return [*stmts, update]


def _sgd_momentum_update(e: Emit) -> list[str]:
    """ATen's fused SGD (one pass; dampening 0, and a zero buffer makes step 1 buf = d)."""
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, buf, lr = e.ins[1:4]
    momentum, decay = float(e.attr("momentum")), float(e.attr("weight_decay"))
    nesterov = bool(e.attr("nesterov"))
    if _small(e):
        hyper = literal((momentum, decay, nesterov))
        return [*stmts, f"pe_sgd_momentum_small_({w}, {g}, {buf}, {lr}, {_flag(e, 4)}, {hyper})"]
    args = (
        f"[{w}], [laid_out_as({g}, {w})], [{buf}], weight_decay={literal(decay)}"
        f", momentum={literal(momentum)}, lr={lr}, dampening=0.0"
        f", nesterov={nesterov}, maximize=False, is_first_step=False"
    )
    return [*stmts, f"aten_fused_sgd_({args}{_skip(e, 4)})"]


def _adamw_update(e: Emit) -> list[str]:
    """ATen's fused AdamW (one pass over w, g, m, v; the step count t is read from a tensor).
    Its kernel indexes raw memory, so the gradient is laid out as the param first."""
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, m, v, t, lr = e.ins[1:6]
    keys = ("beta1", "beta2", "eps", "weight_decay")
    if _small(e):
        hyper = literal(tuple(float(e.attr(k)) for k in keys))
        return [*stmts, f"pe_adamw_small_({w}, {g}, {m}, {v}, {t}, {lr}, {_flag(e, 6)}, {hyper})"]
    named = ", ".join(f"{k}={literal(float(e.attr(k)))}" for k in keys)
    args = f"[{w}], [laid_out_as({g}, {w})], [{m}], [{v}], [], [{t}], lr={lr}, {named}"
    return [*stmts, f"aten_fused_adamw_({args}, amsgrad=False, maximize=False{_skip(e, 6)})"]


KERNELS: dict[str, Emitter] = {
    "sgd_update": _sgd_update,
    "sgd_momentum_update": _sgd_momentum_update,
    "adamw_update": _adamw_update,
}

NAMESPACE: dict[str, Callable[..., Any]] = {
    "aten_fused_sgd_": torch._fused_sgd_,
    "aten_fused_adamw_": torch._fused_adamw_,
    "laid_out_as": _laid_out_as,
    "pe_adamw_small_": adamw_small_,
    "pe_sgd_momentum_small_": sgd_momentum_small_,
}
