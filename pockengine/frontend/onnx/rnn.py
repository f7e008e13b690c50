"""ONNX recurrent layers (``LSTM``, ``GRU``, ``RNN``), unrolled over their time steps.

The sequence length is static, so each layer becomes its steps' matmuls and gates, as
the ONNX operator defines them: the input projection of every step at once, then per
step the recurrent projection and the gates; ``reverse`` runs the steps backwards and
``bidirectional`` both ways. Autodiff then differentiates the unrolled steps like any
other graph (backpropagation through time). Supported: the default activations (RNN:
Tanh or Relu), biases, initial states, LSTM peepholes, GRU's ``linear_before_reset``,
both layouts; not: ``clip``, ``input_forget``, sequence lengths given as an input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pockengine.frontend.onnx.converters import Ctx, Operand, onnx_op
from pockengine.ir import CompileError, Value

__all__: list[str] = []

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _part(cx: Ctx, v: Value, axis: int, k: int, parts: int) -> Value:
    """The k-th of ``parts`` equal pieces of ``axis``."""
    size = v.shape[axis] // parts
    return cx.call("slice", v, axis=axis, start=k * size, stop=(k + 1) * size, step=1)


def _t(cx: Ctx, v: Value) -> Value:
    return cx.call("transpose", v, perm=(1, 0))


@dataclass
class _Direction:
    """One direction's weights (``w`` [G*h, in], ``r`` [G*h, h], biases [G*h]) and state."""

    kind: str
    r: Value
    rb: Value | None
    h: Value
    c: Value | None = None
    peep: list[Value] | None = None
    before_reset: bool = False
    act: str = "tanh"

    def recur(self, cx: Ctx, h: Value, r: Value, rb: Value | None) -> Value:
        out = cx.call("matmul", h, _t(cx, r))
        return out if rb is None else cx.call("add", out, rb)

    def step(self, cx: Ctx, xt: Value) -> Value:
        """One time step from ``xt`` (the input projection, biases added); the new h."""
        if self.kind == "LSTM":
            return self._lstm(cx, xt)
        if self.kind == "GRU":
            return self._gru(cx, xt)
        self.h = cx.call(self.act, cx.call("add", xt, self.recur(cx, self.h, self.r, self.rb)))
        return self.h

    def _lstm(self, cx: Ctx, xt: Value) -> Value:
        z = cx.call("add", xt, self.recur(cx, self.h, self.r, self.rb))
        i, o, f, g = (_part(cx, z, 1, k, 4) for k in range(4))  # ONNX order: i, o, f, c
        prev = self.c
        assert prev is not None
        if self.peep is not None:  # i and f read C(t-1), o reads C(t)
            i = cx.call("add", i, cx.call("mul", self.peep[0], prev))
            f = cx.call("add", f, cx.call("mul", self.peep[2], prev))
        i, f, g = cx.call("sigmoid", i), cx.call("sigmoid", f), cx.call("tanh", g)
        self.c = cx.call("add", cx.call("mul", f, prev), cx.call("mul", i, g))
        if self.peep is not None:
            o = cx.call("add", o, cx.call("mul", self.peep[1], self.c))
        self.h = cx.call("mul", cx.call("sigmoid", o), cx.call("tanh", self.c))
        return self.h

    def _gru(self, cx: Ctx, xt: Value) -> Value:
        xz, xr, xh = (_part(cx, xt, 1, k, 3) for k in range(3))  # ONNX order: z, r, h
        rz, rr, rh = (_part(cx, self.r, 0, k, 3) for k in range(3))
        bz, br, bh = (
            (None, None, None)
            if self.rb is None
            else (_part(cx, self.rb, 0, k, 3) for k in range(3))
        )
        z = cx.call("sigmoid", cx.call("add", xz, self.recur(cx, self.h, rz, bz)))
        r = cx.call("sigmoid", cx.call("add", xr, self.recur(cx, self.h, rr, br)))
        if self.before_reset:
            cand = cx.call("add", xh, cx.call("mul", r, self.recur(cx, self.h, rh, bh)))
        else:
            cand = cx.call("add", xh, self.recur(cx, cx.call("mul", r, self.h), rh, bh))
        keep = cx.call("sub", cx.full(1.0, self.h.dtype), z)
        self.h = cx.call(
            "add", cx.call("mul", keep, cx.call("tanh", cand)), cx.call("mul", z, self.h)
        )
        return self.h


def _activations(kind: str, attrs: dict[str, Any], dirs: int) -> list[str]:
    names = [_text(a) for a in attrs.get("activations", [])] or _DEFAULT[kind] * dirs
    if kind == "RNN" and all(n in ("Tanh", "Relu") for n in names):
        return [n.lower() for n in names] * (dirs // len(names) or 1)
    if names not in (_DEFAULT[kind], _DEFAULT[kind] * dirs):
        raise CompileError(f"{kind} activations {names} are not supported (only the defaults)")
    return ["tanh"] * dirs


class _Inputs:
    """The layer's operands as values of X's dtype, one direction at a time."""

    def __init__(self, cx: Ctx, ins: list[Operand], batch_first: bool) -> None:
        self.cx, self.ins = cx, [*ins, *([None] * (8 - len(ins)))]
        self.x = cx.value(ins[0])
        self.w = cx.like(ins[1], self.x)
        self.dirs = self.w.shape[0]
        self.batch_first = batch_first

    def of(self, at: int, d: int, shape: tuple[int, ...]) -> Value | None:
        """Direction ``d``'s part of input ``at`` (initial states of a batch-first layer
        are [batch, dirs, hidden])."""
        given = self.ins[at]
        if given is None:
            return None
        v = self.cx.like(given, self.x)
        if self.batch_first and at in (5, 6):
            v = self.cx.call("transpose", v, perm=(1, 0, 2))
        return self.cx.call("reshape", _part(self.cx, v, 0, d, self.dirs), shape=shape)


def _direction(
    cx: Ctx, kind: str, inp: _Inputs, d: int, xs: Value, attrs: dict[str, Any], act: str
) -> tuple[Value, _Direction]:
    """The input projection of every step of direction ``d`` and its cell."""
    gates, seq, batch = _GATES[kind], xs.shape[0], xs.shape[1]
    hidden = int(attrs.get("hidden_size", inp.w.shape[1] // gates))
    w = inp.of(1, d, (gates * hidden, xs.shape[2]))
    r = inp.of(2, d, (gates * hidden, hidden))
    b = inp.of(3, d, (2 * gates * hidden,))
    assert w is not None and r is not None
    proj = cx.call("matmul", xs, _t(cx, w))  # [seq, batch, G*h]
    rb = None
    if b is not None:
        proj, rb = cx.call("add", proj, _part(cx, b, 0, 0, 2)), _part(cx, b, 0, 1, 2)
    h0, c0 = (inp.of(k, d, (batch, hidden)) for k in (5, 6))
    zeros = cx.full(0.0, xs.dtype, (batch, hidden))
    cell = _Direction(
        kind,
        r,
        rb,
        zeros if h0 is None else h0,
        act=act,
        before_reset=bool(int(attrs.get("linear_before_reset", 0))),
    )
    if kind == "LSTM":
        cell.c = zeros if c0 is None else c0
        peep = inp.of(7, d, (3 * hidden,))
        cell.peep = None if peep is None else [_part(cx, peep, 0, k, 3) for k in range(3)]
    assert seq == proj.shape[0]
    return proj, cell


def _layer(kind: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> tuple[Value, ...]:
        if attrs.get("clip") is not None or int(attrs.get("input_forget", 0)):
            raise CompileError(f"{kind} with clip or input_forget is not supported")
        if len(ins) > 4 and ins[4] is not None:
            raise CompileError(f"{kind} with sequence_lens is not supported (pad to one length)")
        first = int(attrs.get("layout", 0)) == 1  # [batch, seq, ...]
        inp = _Inputs(cx, ins, first)
        xs = cx.call("transpose", inp.x, perm=(1, 0, 2)) if first else inp.x
        direction = _text(attrs.get("direction", "forward"))
        backwards = [False, True] if direction == "bidirectional" else [direction == "reverse"]
        acts = _activations(kind, attrs, len(backwards))
        seq, batch = xs.shape[0], xs.shape[1]
        per_dir, cells = [], []
        for d, reverse in enumerate(backwards):
            proj, cell = _direction(cx, kind, inp, d, xs, attrs, acts[d])
            hs: dict[int, Value] = {}
            for t in reversed(range(seq)) if reverse else range(seq):
                xt = cx.call("slice", proj, axis=0, start=t, stop=t + 1, step=1)
                hs[t] = cell.step(cx, cx.call("reshape", xt, shape=(batch, proj.shape[2])))
            per_dir.append(
                [cx.call("reshape", hs[t], shape=(1, 1, *hs[t].shape)) for t in range(seq)]
            )
            cells.append(cell)
        y = _cat(cx, [_cat(cx, list(step), 1) for step in zip(*per_dir, strict=True)], 0)
        last = [
            _cat(cx, [cx.call("reshape", v, shape=(1, *v.shape)) for v in vs], 0)
            for vs in ([c.h for c in cells], [c.c for c in cells if c.c is not None])
            if vs
        ]
        if first:
            y = cx.call("transpose", y, perm=(2, 0, 1, 3))
            last = [cx.call("transpose", v, perm=(1, 0, 2)) for v in last]
        return (y, *last)

    return convert


def _cat(cx: Ctx, parts: list[Value], axis: int) -> Value:
    return parts[0] if len(parts) == 1 else cx.call("concat", *parts, axis=axis)


for _kind in _GATES:
    onnx_op(_kind)(_layer(_kind))
