"""ONNX kernels of ``linear_log_softmax_gather`` and its backward: the op's math in
standard ONNX ops over the whole ``[rows, vocab]`` logits, in one pass rather than chunk
by chunk (a ``Loop`` would keep ONNX Runtime from planning the buffers; what ONNX Runtime
holds inside these few nodes it frees after them, and nothing of size vocab is saved
between forward and backward: the backward recomputes the logits from x, w and lse)."""

from __future__ import annotations

import numpy as np

from pockengine.backends.onnx.emitter import Emitter, Kernel, onnx_dtype, registrar
from pockengine.ir import Node

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


def _k_by_vocab(em: Emitter, node: Node, w: str) -> str:
    """w as [k, vocab]: transposed when the node holds it [vocab, k] (``vocab_major``)."""
    return em.op("Transpose", w, perm=[1, 0]) if node.attrs["vocab_major"] else w


def _logits(em: Emitter, x: str, w: str, bias: list[str]) -> str:
    z = em.op("MatMul", x, w)
    return em.op("Add", z, bias[0]) if bias else z


@_k("linear_log_softmax_gather")
def _forward(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    h, w, index, *bias = x
    _picked_lse(em, _logits(em, h, _k_by_vocab(em, node, w), bias), index, out[:2])


def _picked_lse(em: Emitter, z: str, index: str, out: list[str]) -> str:
    """picked and lse of the logits ``z`` into ``out``; lse kept [rows, 1] is returned."""
    axis = em.ints([1])
    top = em.op("ReduceMax", z, axis, keepdims=1)
    total = em.op("ReduceSum", em.op("Exp", em.op("Sub", z, top)), axis, keepdims=1)
    lse = em.op("Add", top, em.op("Log", total))
    picked = em.op("GatherElements", z, em.op("Unsqueeze", index, axis), axis=1)
    em.op("Squeeze", em.op("Sub", picked, lse), axis, out=out[0])
    em.op("Squeeze", lse, axis, out=out[1])
    return lse


@_k("linear_log_softmax_gather_grad")
def _backward(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gp, scale, h, w, index, lse, *bias = x
    kv = _k_by_vocab(em, node, w)
    z = _logits(em, h, kv, bias)
    _grads(em, node, z, em.op("Unsqueeze", lse, em.ints([1])), (gp, scale, h, kv, index), out)


@_k("linear_log_softmax_gather_with_grad")
def _with_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gp, scale, h, w, index, *bias = x
    kv = _k_by_vocab(em, node, w)
    z = _logits(em, h, kv, bias)
    lse = _picked_lse(em, z, index, out[:2])
    _grads(em, node, z, lse, (gp, scale, h, kv, index), out[2:])


def _grads(
    em: Emitter, node: Node, z: str, lse: str, ins: tuple[str, str, str, str, str], out: list[str]
) -> None:
    """The wanted gradients of dz = scale * exp(z - lse) + gp * onehot(index)."""
    gp, scale, h, kv, index = ins
    axis = em.ints([1])
    major = bool(node.attrs["vocab_major"])
    vocab = node.inputs[3].shape[0 if major else 1]
    p = em.op("Exp", em.op("Sub", z, lse))
    classes = em.const(np.arange(vocab, dtype=np.int64).reshape(1, vocab))
    target = em.op("Unsqueeze", em.op("Cast", index, to=7), axis)  # 7: int64
    onehot = em.op("Cast", em.op("Equal", classes, target), to=onnx_dtype(node.inputs[2].dtype))
    dz = em.op(
        "Add",
        em.op("Mul", p, em.op("Unsqueeze", scale, axis)),
        em.op("Mul", onehot, em.op("Unsqueeze", gp, axis)),
    )
    results = iter(out)
    if node.attrs["x_grad"]:
        em.op("MatMul", dz, em.op("Transpose", kv, perm=[1, 0]), out=next(results))
    if node.attrs["w_grad"] and major:
        em.op("MatMul", em.op("Transpose", dz, perm=[1, 0]), h, out=next(results))
    elif node.attrs["w_grad"]:
        em.op("MatMul", em.op("Transpose", h, perm=[1, 0]), dz, out=next(results))
    if node.attrs["b_grad"]:
        em.op("ReduceSum", dz, em.ints([0]), keepdims=0, out=next(results))
