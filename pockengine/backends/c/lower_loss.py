"""C lowerings of the large-vocabulary loss head (``ops.fused_loss``):
``linear_log_softmax_gather`` and its backward kernel, each one call of ``kernels/loss.c``.

With these the C backend claims the fused ops, so the forward pipeline fuses the loss for
it as for torch (``passes.pipeline``) and the ``[tokens, vocab]`` logits never take arena
space. Targets may be int64 or int32 (``wide``); absent gradients are ``NULL``.
"""

from __future__ import annotations

from pockengine.backends.c.emit import CEmitError, EmitContext, Lowering
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import DType, Node, Value

__all__ = ["KERNELS"]


def _head(node: Node, x: Value, w: Value, index: Value) -> str:
    """The call's shared tail: rows, K, V and the layout flag (``_sfx`` checks x's dtype)."""
    if index.dtype not in (DType.I64, DType.I32):
        raise CEmitError(f"{node.op} takes i64 or i32 targets, got {index}")
    major = bool(node.attrs["vocab_major"])
    vocab = w.shape[0] if major else w.shape[1]
    return f"{x.shape[0]}, {x.shape[1]}, {vocab}, {int(major)}"


def _wide(index: Value) -> int:
    return int(index.dtype is DType.I64)


def _forward(ctx: EmitContext, node: Node) -> str:
    x, w, index, *bias = node.inputs
    picked, lse = (ctx.ref(v) for v in node.outputs)
    tail = _head(node, x, w, index)
    b = ctx.ref(bias[0]) if bias else "NULL"
    return (
        f"pe_linear_log_softmax_gather_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(w)}, {ctx.ref(index)}, "
        f"{_wide(index)}, {b}, {picked}, {lse}, {tail});"
    )


def _backward(ctx: EmitContext, node: Node) -> str:
    gp, scale, x, w, index, lse, *bias = node.inputs
    return _grad_call(ctx, node, (gp, scale, x, w, index), ctx.ref(lse), bias, node.outputs)


def _grad_call(
    ctx: EmitContext, node: Node, ins: tuple[Value, ...], lse: str, bias: list[Value],
    grads: tuple[Value, ...],
) -> str:  # fmt: skip
    x, w, index = ins[2:]
    tail = _head(node, x, w, index)
    outs = iter(ctx.ref(v) for v in grads)
    gx, gw, gb = (next(outs) if node.attrs[k] else "NULL" for k in ("x_grad", "w_grad", "b_grad"))
    b = ctx.ref(bias[0]) if bias else "NULL"
    refs = ", ".join(ctx.ref(v) for v in ins)
    return (
        f"pe_linear_log_softmax_gather_grad_{_sfx(x)}({refs}, {_wide(index)}, {lse}, "
        f"{b}, {gx}, {gw}, {gb}, {tail});"
    )


def _with_grad(ctx: EmitContext, node: Node) -> str:
    """Both kernels in turn (the C kernels make each chunk's logits twice, as the unfused
    pair does: the C backend gains the op, not its saved matmul)."""
    gp, scale, x, w, index, *bias = node.inputs
    picked, lse, *grads = node.outputs
    forward = node.replace(op="linear_log_softmax_gather", inputs=(x, w, index, *bias),
                           outputs=(picked, lse))  # fmt: skip
    return (
        _forward(ctx, forward) + "\n"
        + _grad_call(ctx, node, (gp, scale, x, w, index), ctx.ref(lse), bias, tuple(grads))
    )  # fmt: skip


KERNELS: dict[str, Lowering] = {
    "linear_log_softmax_gather": _forward,
    "linear_log_softmax_gather_grad": _backward,
    "linear_log_softmax_gather_with_grad": _with_grad,
}
