"""Lowerings into IR ops that more than one frontend needs."""

from __future__ import annotations

from typing import Any

from pockengine.ir import GraphBuilder, Value

__all__ = ["batch_norm_eval"]


def batch_norm_eval(
    b: GraphBuilder,
    source: str,
    x: Value,
    w: Value,
    bias: Value,
    mean: Value,
    var: Value,
    eps: float,
) -> Value:
    """Eval-mode BatchNorm over axis 1 as elementwise ops on running statistics:
    y = x * scale + shift, scale = w * rsqrt(var + eps), shift = bias - mean * scale."""

    def call(op: str, *inputs: Value, **attrs: Any) -> Value:
        return b.call(op, *inputs, source=source, **attrs)

    def per_channel(v: Value) -> Value:
        return call("reshape", v, shape=(v.shape[0],) + (1,) * (x.type.rank - 2))

    eps_v = call("full", shape=(), value=eps, dtype=str(var.dtype))
    scale = call("mul", w, call("rsqrt", call("add", var, eps_v)))
    shift = call("sub", bias, call("mul", mean, scale))
    return call("add", call("mul", x, per_channel(scale)), per_channel(shift))
