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
    tail = _head(node, x, w, index)
    outs = iter(ctx.ref(v) for v in node.outputs)
    gx, gw, gb = (next(outs) if node.attrs[k] else "NULL" for k in ("x_grad", "w_grad", "b_grad"))
    b = ctx.ref(bias[0]) if bias else "NULL"
    ins = ", ".join(ctx.ref(v) for v in (gp, scale, x, w, index))
    return (
        f"pe_linear_log_softmax_gather_grad_{_sfx(x)}({ins}, {_wide(index)}, {ctx.ref(lse)}, "
        f"{b}, {gx}, {gw}, {gb}, {tail});"
    )


KERNELS: dict[str, Lowering] = {
    "linear_log_softmax_gather": _forward,
    "linear_log_softmax_gather_grad": _backward,
}
