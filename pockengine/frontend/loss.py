"""The named losses of the ONNX and Keras frontends, written in IR ops on one model output.

An ONNX or Keras model holds the network, not its loss, so ``compile`` names one:

- ``cross_entropy``: logits [N, C] or [N, C, d...] and int class targets [N] or
  [N, d...], as ``F.cross_entropy`` (mean over targets other than ignore_index -100);
- ``mse``: mean of (output - target)^2, target of the output's shape and dtype;
- ``causal_lm``: logits [B, T, V] and token ids [B, T] (by default the model's first
  input): the cross-entropy of each next token, as Hugging Face's causal LM loss;
- ``none``: the output is already the scalar loss.
"""

from __future__ import annotations

from pockengine.frontend.operands import Ctx
from pockengine.ir import CompileError, DType, TensorType, Value

__all__ = ["LOSSES", "apply_loss", "target_types"]

LOSSES = ("cross_entropy", "mse", "causal_lm", "none")
IGNORE_INDEX = -100


def target_types(loss: str, out: Value, have_labels: bool) -> list[TensorType]:
    """The batch entries a loss needs after the model's inputs (causal_lm: optional labels)."""
    if loss == "none":
        return []
    if loss == "cross_entropy":
        return [TensorType((out.shape[0], *out.shape[2:]), DType.I64)]
    if loss == "mse":
        return [out.type]
    if loss == "causal_lm":
        return [TensorType(out.shape[:2], DType.I64)] if have_labels else []
    raise CompileError(f"unknown loss {loss!r}; known: {', '.join(LOSSES)}")


def _cross_entropy(cx: Ctx, logits: Value, target: Value) -> Value:
    if logits.type.rank < 2:
        raise CompileError(f"cross_entropy needs logits [N, C, ...], got {logits.type}")
    if not logits.dtype.is_float:
        raise CompileError(f"cross_entropy needs float logits, got {logits.type}")
    classes = logits.shape[1]
    if logits.type.rank > 2:  # classes last, then one row per target
        rank = logits.type.rank
        logits = cx.call("transpose", logits, perm=(0, *range(2, rank), 1))
    rows = target.type.numel
    logits = cx.call("reshape", logits, shape=(rows, classes))
    target = cx.call("reshape", cx.cast(target, DType.I64), shape=(rows, 1))
    valid = cx.call("ne", target, cx.full(IGNORE_INDEX, DType.I64))
    safe = cx.call("where", valid, target, cx.full(0, DType.I64))
    picked = cx.call("gather", cx.call("log_softmax", logits, axis=1), safe, axis=1)
    picked = cx.call("where", valid, picked, cx.full(0.0, logits.dtype))
    count = cx.call("sum", cx.cast(valid, logits.dtype), axes=None, keepdims=False)
    total = cx.call("sum", picked, axes=None, keepdims=False)
    return cx.call("neg", cx.call("div", total, count))


def _mse(cx: Ctx, out: Value, target: Value) -> Value:
    diff = cx.call("sub", out, cx.cast(target, out.dtype))
    return cx.call("mean", cx.call("mul", diff, diff), axes=None, keepdims=False)


def _causal_lm(cx: Ctx, logits: Value, labels: Value) -> Value:
    if logits.type.rank != 3 or labels.shape != logits.shape[:2]:
        raise CompileError(
            f"causal_lm needs logits [B, T, V] and ids [B, T], got {logits.type} and {labels.type}"
        )
    t = logits.shape[1]
    head = cx.call("slice", logits, axis=1, start=0, stop=t - 1, step=1)
    tail = cx.call("slice", labels, axis=1, start=1, stop=t, step=1)
    head = cx.call("transpose", head, perm=(0, 2, 1))  # [B, V, T-1], classes on axis 1
    return _cross_entropy(cx, head, tail)


def apply_loss(cx: Ctx, loss: str, out: Value, targets: list[Value]) -> Value:
    """The scalar loss of ``out`` against the target batch entries."""
    cx.source = "loss"
    if loss == "none":
        if out.shape != () or not out.dtype.is_float:
            raise CompileError(f"loss='none' needs a float scalar output, got {out.type}")
        return out
    if loss == "cross_entropy":
        return _cross_entropy(cx, out, targets[0])
    if loss == "mse":
        return _mse(cx, out, targets[0])
    return _causal_lm(cx, out, targets[0])
