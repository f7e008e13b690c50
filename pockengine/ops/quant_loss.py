"""The fused loss head on a low-bit frozen matrix: ``dequantize_<op>`` for the three ops of
``ops.fused_loss`` (``linear_log_softmax_gather``, its ``_grad`` and ``_with_grad``).

Each takes its base op's inputs with ``w`` replaced by the codes, no bias, and the scales
(and offsets) appended: ``dequantize_linear_log_softmax_gather(x, codes, index, scales[,
offsets], scheme, group, chunk, vocab_major)`` is ``linear_log_softmax_gather(x,
dequantize(codes, scales[, offsets]), index, chunk, vocab_major)``, and so on; the weight
and bias gradients are never asked (the matrix is frozen). A backend that reads the codes
inside its tiles of logits never holds the float matrix: the C backend rewrites a tied,
quantized LM head into these (``backends/c/fuse_lowbit.py``). Made after autodiff, so no
VJP; the NumPy kernels are the unfused definition.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.ir import Attrs, OpDef, Sample, ShapeError, TensorType, get_op, register
from pockengine.ir.arrays import Array
from pockengine.ops.quant import Dequantize, dequantize_array, quantize_int4, quantize_int8

__all__ = ["LOWBIT_LOSS", "split_inputs"]

# base op -> (the number of its inputs before the bias, the position of w)
LOWBIT_LOSS = {
    "linear_log_softmax_gather": (3, 1),
    "linear_log_softmax_gather_grad": (6, 3),
    "linear_log_softmax_gather_with_grad": (5, 3),
}
_QUANT_ATTRS = ("scheme", "group")


def split_inputs(base: str, inputs: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    """A variant's inputs as the base op's inputs (the codes where w goes) and the
    dequantize operands (codes, scales[, offsets])."""
    fixed, at = LOWBIT_LOSS[base]
    head = list(inputs[:fixed])
    return head, [head[at], *inputs[fixed:]]


def _make(base: str) -> OpDef:
    opdef = get_op(base)
    at = LOWBIT_LOSS[base][1]

    def infer(*types: TensorType, scheme: str, group: int, **attrs: Any) -> Any:
        head, quantized = split_inputs(base, types)
        if len(quantized) not in (2, 3):
            raise ShapeError(f"dequantize_{base}: scales and at most one offsets tensor")
        if attrs.get("w_grad") or attrs.get("b_grad"):
            raise ShapeError(f"dequantize_{base}: a frozen matrix has no weight gradient")
        head[at] = Dequantize.infer(*quantized, scheme=scheme, group=group)
        return opdef.infer(*head, **attrs)

    def kernel(*arrays: Array, scheme: str, group: int, **attrs: Any) -> Any:
        head, (codes, scales, *offsets) = split_inputs(base, arrays)
        head[at] = dequantize_array(
            codes, scales, offsets[0] if offsets else None, scheme=scheme, group=group
        )
        return opdef.kernel(*head, **attrs)

    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        head, quantized = split_inputs(base, ins)
        kw = Attrs({k: v for k, v in attrs.items() if k not in _QUANT_ATTRS})
        head[at] = Dequantize.infer(*quantized, **{k: attrs[k] for k in _QUANT_ATTRS})
        return int(opdef.flops(tuple(head), outs, kw))

    def samples(rng: np.random.Generator) -> list[Sample]:
        return _samples(base, rng)

    doc = f"``{base}`` with w = dequantize(codes, scales[, offsets]) (ops/quant_loss.py)."
    return OpDef(f"dequantize_{base}", infer, kernel, None, flops, (), opdef.facts, samples, doc)


def _samples(base: str, rng: np.random.Generator) -> list[Sample]:
    x, w = rng.standard_normal((5, 64)), rng.standard_normal((7, 64))
    index = rng.integers(0, 7, 5)
    q8, q4 = quantize_int8(w, 32), quantize_int4(w, 32)
    out = []
    for q, chunk in ((q8, 2), (q4, 5)):
        dense = dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme, group=q.group)
        extra = tuple(a.astype(np.float64) for a in q.arrays[1:])
        attrs: dict[str, Any] = {"chunk": chunk, "vocab_major": True}
        _, lse = get_op("linear_log_softmax_gather").kernel(x, dense, index, **attrs)
        gp, scale = rng.standard_normal(5), rng.standard_normal(5)
        grads = {"x_grad": True, "w_grad": False, "b_grad": False}
        head = {
            "linear_log_softmax_gather": (x, q.codes, index),
            "linear_log_softmax_gather_grad": (gp, scale, x, q.codes, index, lse),
            "linear_log_softmax_gather_with_grad": (gp, scale, x, q.codes, index),
        }[base]
        more = {} if base == "linear_log_softmax_gather" else grads
        out.append(Sample((*head, *extra), {**attrs, **more, "scheme": q.scheme, "group": q.group}))
    return out


for _base in LOWBIT_LOSS:
    register(_make(_base))
