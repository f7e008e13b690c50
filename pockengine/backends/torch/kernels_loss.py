"""Torch kernels of ``linear_log_softmax_gather``, its backward, and both at once
(``linear_log_softmax_gather_with_grad``), chunked over rows.

Each chunk's logits are one ``addmm`` (or ``mm``) into one ``[chunk, vocab]`` buffer that
every chunk reuses, and everything else over it runs in place (the log-sum-exp as
``amax``, ``sub_``, ``exp_``, ``sum``), so the ``[rows, vocab]`` logits, probabilities and
their gradient never exist whole and a call allocates one such buffer; the backward
recomputes the chunk's probabilities in place from the saved log-sum-exp and accumulates
the weight gradient with ``addmm_``.
"""

from __future__ import annotations

from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal

__all__ = ["KERNELS", "NAMESPACE"]


def _logits(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, buffer: torch.Tensor
) -> torch.Tensor:
    """x @ w (+ bias) written into the first rows of ``buffer`` (one buffer for all chunks)."""
    out = buffer[: x.shape[0]]
    return torch.mm(x, w, out=out) if bias is None else torch.addmm(bias, x, w, out=out)


def _buffer(x: torch.Tensor, chunk: int, vocab: int) -> torch.Tensor:
    return x.new_empty((min(chunk, x.shape[0]), vocab))


def linear_log_softmax_gather(
    x: torch.Tensor,
    w: torch.Tensor,
    index: torch.Tensor,
    bias: torch.Tensor | None,
    chunk: int,
    vocab_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """picked and lse of x @ w (+ bias), ``chunk`` rows at a time (w [vocab, k] when
    ``vocab_major``: its transpose is a view)."""
    rows = x.shape[0]
    picked, lse = x.new_empty(rows), x.new_empty(rows)
    index, w = index.long(), w.t() if vocab_major else w
    buffer = _buffer(x, chunk, w.shape[1])
    for start in range(0, rows, chunk):
        at = slice(start, min(rows, start + chunk))
        _picked_lse_(_logits(x[at], w, bias, buffer), index, picked, lse, at)
    return picked, lse


def _picked_lse_(
    z: torch.Tensor, index: torch.Tensor, picked: torch.Tensor, lse: torch.Tensor, at: slice
) -> torch.Tensor:
    """picked[at] and lse[at] of the chunk's logits ``z``, which become exp(z - max) in
    place; returns their row sums (``[rows, 1]``), softmax's denominators."""
    torch.gather(z, 1, index[at, None], out=picked[at, None])
    top = z.amax(1, keepdim=True)
    total = z.sub_(top).exp_().sum(1, keepdim=True)
    torch.add(total.log().squeeze_(1), top.squeeze_(1), out=lse[at])
    picked[at] -= lse[at]
    return total


def linear_log_softmax_gather_grad(
    gp: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    index: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    chunk: int,
    vocab_major: bool,
    wanted: tuple[bool, bool, bool],
    outs: _Outs = (None, None, None),
) -> tuple[torch.Tensor, ...]:
    """The wanted ones of gx, gw, gb: dz = scale * softmax(z) + gp * onehot(index) per
    chunk, its logits recomputed; gw in w's own layout, written contiguously. ``outs``:
    tensors to write gx, gw, gb into (workspace slots; None: allocated)."""
    rows, kv = x.shape[0], w.t() if vocab_major else w  # kv: [k, vocab]
    grads = _Grads(x, w, kv, wanted, outs)
    index, buffer = index.long(), _buffer(x, chunk, kv.shape[1])
    for start in range(0, rows, chunk):
        at = slice(start, min(rows, start + chunk))
        dz = _logits(x[at], kv, bias, buffer).sub_(lse[at, None]).exp_().mul_(scale[at, None])
        dz.scatter_add_(1, index[at, None], gp[at, None])
        grads.add(dz, x, kv, at, vocab_major)
    return grads.wanted()


def linear_log_softmax_gather_with_grad(
    gp: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    index: torch.Tensor,
    bias: torch.Tensor | None,
    chunk: int,
    vocab_major: bool,
    wanted: tuple[bool, bool, bool],
    outs: _Outs = (None, None, None),
) -> tuple[torch.Tensor, ...]:
    """picked, lse and the wanted gradients, each chunk's logits made once: exp(z - top)
    gives the log-sum-exp's sum and, divided by it, softmax(z) in the same buffer.
    ``outs``: as ``linear_log_softmax_gather_grad``'s."""
    rows, kv = x.shape[0], w.t() if vocab_major else w
    picked, lse = x.new_empty(rows), x.new_empty(rows)
    grads = _Grads(x, w, kv, wanted, outs)
    index, buffer = index.long(), _buffer(x, chunk, kv.shape[1])
    for start in range(0, rows, chunk):
        at = slice(start, min(rows, start + chunk))
        z = _logits(x[at], kv, bias, buffer)
        total = _picked_lse_(z, index, picked, lse, at)
        dz = z.mul_(scale[at, None] / total)  # softmax(z) * scale
        dz.scatter_add_(1, index[at, None], gp[at, None])
        grads.add(dz, x, kv, at, vocab_major)
    return (picked, lse, *grads.wanted())


_Outs = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class _Grads:
    """gx (by rows), gw and gb (accumulated over chunks), those ``wanted`` made: each in
    its tensor of ``outs`` where given (a workspace slot of the result's shape and dtype),
    else allocated. gw is the first chunk's product (``mm``), then accumulated (``addmm_``):
    never zero-filled."""

    def __init__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        kv: torch.Tensor,
        wanted: tuple[bool, bool, bool],
        outs: _Outs,
    ) -> None:
        x_grad, w_grad, b_grad = wanted
        gx_out, self.gw_out, gb_out = outs
        self.gx = (gx_out if gx_out is not None else torch.empty_like(x)) if x_grad else None
        self.w_grad, self._w = w_grad, w
        self.gw: torch.Tensor | None = None
        self.gb = None
        if b_grad:
            self.gb = gb_out.zero_() if gb_out is not None else kv.new_zeros(kv.shape[1])

    def add(
        self, dz: torch.Tensor, x: torch.Tensor, kv: torch.Tensor, at: slice, vocab_major: bool
    ) -> None:
        if self.gx is not None:
            torch.mm(dz, kv.t(), out=self.gx[at])
        if self.w_grad:
            a, b = (dz.t(), x[at]) if vocab_major else (x[at].t(), dz)
            if self.gw is not None:
                self.gw.addmm_(a, b)
            elif self.gw_out is not None:
                self.gw = torch.mm(a, b, out=self.gw_out)
            else:
                self.gw = torch.mm(a, b)
        if self.gb is not None:
            self.gb.add_(dz.sum(0))

    def wanted(self) -> tuple[torch.Tensor, ...]:
        if self.w_grad and self.gw is None:  # no rows: no chunk made it
            self.gw = (
                self.gw_out.zero_() if self.gw_out is not None else self._w.new_zeros(self._w.shape)
            )
        return tuple(g for g in (self.gx, self.gw, self.gb) if g is not None)


def _forward(e: Emit) -> list[str]:
    x, w, index, *bias = e.ins
    args = f"{x}, {w}, {index}, {_attrs(e, bias)}"
    return [f"{', '.join(e.outs)} = linear_log_softmax_gather({args})"]


def _backward(e: Emit) -> list[str]:
    gp, scale, x, w, index, lse, *bias = e.ins
    args = f"{gp}, {scale}, {x}, {w}, {index}, {lse}, {_attrs(e, bias, grads=0)}"
    return [f"{', '.join(e.outs)}, = linear_log_softmax_gather_grad({args})"]


def _with_grad(e: Emit) -> list[str]:
    gp, scale, x, w, index, *bias = e.ins
    args = f"{gp}, {scale}, {x}, {w}, {index}, {_attrs(e, bias, grads=2)}"
    return [f"{', '.join(e.outs)} = linear_log_softmax_gather_with_grad({args})"]


_GRADS = ("x_grad", "w_grad", "b_grad")


def _attrs(e: Emit, bias: list[str], grads: int | None = None) -> str:
    """The call's tail: the bias (or None), chunk, vocab_major and, for the gradient
    kernels (whose gradients are the results from index ``grads`` on), which of gx, gw, gb
    are wanted and the workspace slots they go to (``Emit.dest``)."""
    tail = [bias[0] if bias else "None", literal(int(e.attr("chunk"))),
            literal(bool(e.attr("vocab_major")))]  # fmt: skip
    if grads is not None:
        wanted = tuple(bool(e.attr(k)) for k in _GRADS)
        tail.append(literal(wanted))
        results = iter(range(grads, grads + sum(wanted)))
        slots = [e.dest(result=next(results)) if w else None for w in wanted]
        if any(slots):
            tail.append(f"({', '.join(s or 'None' for s in slots)})")
    return ", ".join(tail)


KERNELS: dict[str, Emitter] = {
    "linear_log_softmax_gather": _forward,
    "linear_log_softmax_gather_grad": _backward,
    "linear_log_softmax_gather_with_grad": _with_grad,
}

NAMESPACE: dict[str, Any] = {
    "linear_log_softmax_gather": linear_log_softmax_gather,
    "linear_log_softmax_gather_grad": linear_log_softmax_gather_grad,
    "linear_log_softmax_gather_with_grad": linear_log_softmax_gather_with_grad,
}
