"""C lowerings of the large-vocabulary loss head (``ops.fused_loss``):
``linear_log_softmax_gather``, its backward kernel and the two merged
(``..._with_grad``), each one call of ``kernels/loss.c``.

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
    return (
        f"pe_linear_log_softmax_gather_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(w)}, {ctx.ref(index)}, "
        f"{_wide(index)}, {_bias(ctx, bias)}, {picked}, {lse}, {_head(node, x, w, index)});"
    )


def _backward(ctx: EmitContext, node: Node) -> str:
    gp, scale, x, w, index, lse, *bias = node.inputs
    refs = ", ".join(ctx.ref(v) for v in (gp, scale, x, w, index))
    return (
        f"pe_linear_log_softmax_gather_grad_{_sfx(x)}({refs}, {_wide(index)}, {ctx.ref(lse)}, "
        f"{_bias(ctx, bias)}, {_grads(ctx, node, node.outputs)}, {_head(node, x, w, index)});"
    )


def _with_grad(ctx: EmitContext, node: Node) -> str:
    """One kernel: each row chunk's logits made once for the forward and the input
    gradient (``kernels/loss.c``); the weight and bias gradients, where asked, take a
    second pass."""
    gp, scale, x, w, index, *bias = node.inputs
    picked, lse, *grads = node.outputs
    refs = ", ".join(ctx.ref(v) for v in (gp, scale, x, w, index))
    return (
        f"pe_linear_log_softmax_gather_with_grad_{_sfx(x)}({refs}, {_wide(index)}, "
        f"{_bias(ctx, bias)}, {ctx.ref(picked)}, {ctx.ref(lse)}, "
        f"{_grads(ctx, node, tuple(grads))}, {_head(node, x, w, index)});"
    )


def _bias(ctx: EmitContext, bias: list[Value]) -> str:
    return ctx.ref(bias[0]) if bias else "NULL"


def _grads(ctx: EmitContext, node: Node, grads: tuple[Value, ...]) -> str:
    """The gx, gw and gb pointers, in that order: the node's gradient outputs where its
    attributes ask for them, NULL where not."""
    outs = iter(ctx.ref(v) for v in grads)
    return ", ".join(
        next(outs) if node.attrs[k] else "NULL" for k in ("x_grad", "w_grad", "b_grad")
    )


KERNELS: dict[str, Lowering] = {
    "linear_log_softmax_gather": _forward,
    "linear_log_softmax_gather_grad": _backward,
    "linear_log_softmax_gather_with_grad": _with_grad,
}
