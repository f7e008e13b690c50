"""ONNX kernels of ``attention`` and ``attention_grad``: the op's math in standard ONNX
ops (MatMul, Softmax pieces, Where), the probabilities recomputed from lse in the
backward as the op defines. ONNX Runtime fuses none of it; the graph stays portable."""

from __future__ import annotations

import numpy as np

from pockengine.backends.onnx.emitter import Emitter, Kernel, registrar
from pockengine.ir import Node

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


def _t(em: Emitter, x: str) -> str:
    return em.op("Transpose", x, perm=[0, 1, 3, 2])


def _scale(em: Emitter, node: Node) -> str:
    scale = node.attrs["scale"]
    assert isinstance(scale, float | int)
    return em.scalar(float(scale), node.inputs[-1].dtype)


def _scores(em: Emitter, node: Node, q: str, k: str, masks: list[str]) -> str:
    """q @ k^T * scale + mask, with -inf above the diagonal if causal."""
    first = 0 if node.op == "attention" else 1  # attention_grad's inputs start with gout
    qt, kt = node.inputs[first], node.inputs[first + 1]
    s = em.op("Mul", em.op("MatMul", q, _t(em, k)), _scale(em, node))
    for m in masks:
        s = em.op("Add", s, m)
    if node.attrs["causal"]:
        keep = em.const(np.tri(qt.shape[2], kt.shape[2], dtype=bool))
        s = em.op("Where", keep, s, em.scalar(-np.inf, qt.dtype))
    return s


@_k("attention")
def _attention(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    q, k, v, *masks = x
    dt = node.inputs[0].dtype
    s = _scores(em, node, q, k, masks)
    last = em.ints([-1])
    top = em.op("ReduceMax", s, last, keepdims=1)
    top = em.op("Where", em.op("IsInf", top, detect_positive=0), em.scalar(0, dt), top)
    e = em.op("Exp", em.op("Sub", s, top))
    total = em.op("ReduceSum", e, last, keepdims=1)
    total = em.op("Where", em.op("Equal", total, em.scalar(0, dt)), em.scalar(1, dt), total)
    em.op("MatMul", em.op("Div", e, total), v, out=out[0])
    em.op("Squeeze", em.op("Add", top, em.op("Log", total)), last, out=out[1])


@_k("attention_grad")
def _attention_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gout, q, k, v, o, lse, *masks = x
    last = em.ints([-1])
    s = _scores(em, node, q, k, masks)
    p = em.op("Exp", em.op("Sub", s, em.op("Unsqueeze", lse, last)))
    em.op("MatMul", _t(em, p), gout, out=out[2])
    delta = em.op("ReduceSum", em.op("Mul", gout, o), last, keepdims=1)
    dp = em.op("MatMul", gout, _t(em, v))
    ds = em.op("Mul", em.op("Mul", p, em.op("Sub", dp, delta)), _scale(em, node))
    em.op("MatMul", ds, k, out=out[0])
    em.op("MatMul", _t(em, ds), q, out=out[1])
