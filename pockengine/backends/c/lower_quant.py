"""C lowering of low-bit frozen weights: ``dequantize``, one call of ``kernels/quant.c``;
``dequantize_matmul``, one ``pe_qgemm`` (``kernels/lowbit_gemm.c``: the GEMM packing its
panels from the codes); the fused loss head on a low-bit table,
``dequantize_linear_log_softmax_gather*``, one ``pe_qlinear_*`` call of ``kernels/loss.c``.

Codes are ``int8_t`` (int8) or packed ``uint8_t`` (4-bit); scales and offsets have the
result's type, or are GGUF's f16 (``uint16_t`` bits in C, converted per group by the
kernel; the result is then float32). f16 values are raw bits to the emitter: only
the ops above, whose kernels convert them, and ``index`` (an embedding's rows of the scales and
offsets, copied as they are) may read them (``HALF_OPS``), so no other op does arithmetic
on the bits.
"""

from __future__ import annotations

from pockengine.backends.c.emit import CEmitError, EmitContext, Lowering
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import DType, Node, Value
from pockengine.ops.quant_loss import LOWBIT_LOSS, split_inputs

__all__ = ["HALF_OPS", "KERNELS", "half_ok"]

# the ops that may read or write f16 bits
HALF_OPS = frozenset(
    {"dequantize", "dequantize_matmul", "index", *(f"dequantize_{op}" for op in LOWBIT_LOSS)}
)
_SCHEMES = {"int8": 0, "int4": 1, "int4_sym": 2}  # enum pe_quant_scheme


def half_ok(node: Node) -> bool:
    """Whether ``node`` may touch f16 values in C: none, or an op that moves or converts
    the bits (``HALF_OPS``) without arithmetic on them."""
    values = (*node.inputs, *node.outputs)
    return node.op in HALF_OPS or all(v.dtype is not DType.F16 for v in values)


def _dequantize(ctx: EmitContext, node: Node) -> str:
    codes, scales, *offsets = node.inputs
    out = node.outputs[0]
    scheme = node.attrs.get("scheme")
    group = node.attrs.get("group")
    if scheme not in _SCHEMES or not isinstance(group, int):
        raise CEmitError(f"dequantize: scheme {scheme!r}, group {group!r}")
    half = scales.dtype is DType.F16
    if not half and scales.dtype is not out.dtype:
        raise CEmitError(f"dequantize: {scales.dtype} scales into {out.dtype}")
    offset = ctx.ref(offsets[0]) if offsets else "NULL"
    groups = out.type.numel // group
    return (
        f"pe_dequantize_{_sfx(out)}({ctx.ref(codes)}, {ctx.ref(scales)}, {offset}, "
        f"{_SCHEMES[scheme]}, {int(half)}, {groups}, {group}, {ctx.ref(out)});"
    )


KERNELS: dict[str, Lowering] = {"dequantize": _dequantize}


def _dequantize_matmul(ctx: EmitContext, node: Node) -> str:
    x, codes, scales, *offsets = node.inputs
    out = node.outputs[0]
    scheme, group = node.attrs.get("scheme"), node.attrs.get("group")
    if scheme not in _SCHEMES or not isinstance(group, int) or codes.type.rank != 2:
        raise CEmitError(f"dequantize_matmul: scheme {scheme!r}, group {group!r}, {codes}")
    half = scales.dtype is DType.F16
    if (not half and scales.dtype is not out.dtype) or x.dtype is not out.dtype:
        raise CEmitError(f"dequantize_matmul: {x.dtype} x, {scales.dtype} scales into {out.dtype}")
    rows = codes.shape[0]
    cols = codes.shape[1] * (1 if scheme == "int8" else 2)
    transpose = bool(node.attrs.get("transpose"))
    k, n = (cols, rows) if transpose else (rows, cols)
    m = x.type.numel // k if k else 0
    offset = ctx.ref(offsets[0]) if offsets else "NULL"
    matrix = (
        f"pe_qmat w = {{{ctx.ref(codes)}, {ctx.ref(scales)}, {offset}, {_SCHEMES[scheme]}, "
        f"{int(half)}, {group}, {rows}, {cols}}};"
    )
    call = (
        f"pe_qgemm_{_sfx(out)}({m}, {n}, {k}, {ctx.ref(x)}, {k}, &w, 0, {int(transpose)}, "
        f"{ctx.ref(out)}, {n}, 0);"
    )
    return f"{{ {matrix} {call} }}"


KERNELS["dequantize_matmul"] = _dequantize_matmul


def _table(ctx: EmitContext, node: Node, quantized: list[Value]) -> tuple[str, int, int]:
    """A ``pe_qmat w`` declaration of a loss head's low-bit [V, K] table, and V, K."""
    codes, scales, *offsets = quantized
    scheme, group = node.attrs.get("scheme"), node.attrs.get("group")
    if scheme not in _SCHEMES or not isinstance(group, int) or codes.type.rank != 2:
        raise CEmitError(f"{node.op}: scheme {scheme!r}, group {group!r}, {codes}")
    if not node.attrs.get("vocab_major"):
        raise CEmitError(f"{node.op}: the C kernel takes a [vocab, k] table")
    half = scales.dtype is DType.F16
    if not half and scales.dtype is not node.outputs[0].dtype:
        raise CEmitError(f"{node.op}: {scales.dtype} scales")
    rows, cols = codes.shape[0], codes.shape[1] * (1 if scheme == "int8" else 2)
    offset = ctx.ref(offsets[0]) if offsets else "NULL"
    decl = (
        f"pe_qmat w = {{{ctx.ref(codes)}, {ctx.ref(scales)}, {offset}, {_SCHEMES[scheme]}, "
        f"{int(half)}, {group}, {rows}, {cols}}};"
    )
    return decl, rows, cols


def _index_wide(index: Value, node: Node) -> int:
    if index.dtype not in (DType.I64, DType.I32):
        raise CEmitError(f"{node.op} takes i64 or i32 targets, got {index}")
    return int(index.dtype is DType.I64)


def _loss_forward(ctx: EmitContext, node: Node) -> str:
    head, quantized = split_inputs("linear_log_softmax_gather", node.inputs)
    x, _, index = head
    decl, vocab, k = _table(ctx, node, quantized)
    picked, lse = (ctx.ref(v) for v in node.outputs)
    call = (
        f"pe_qlinear_log_softmax_gather_{_sfx(x)}({ctx.ref(x)}, &w, {ctx.ref(index)}, "
        f"{_index_wide(index, node)}, {picked}, {lse}, {x.shape[0]}, {k}, {vocab});"
    )
    return f"{{ {decl} {call} }}"


def _loss_backward(ctx: EmitContext, node: Node) -> str:
    head, quantized = split_inputs("linear_log_softmax_gather_grad", node.inputs)
    gp, scale, x, _, index, lse = head
    decl, vocab, k = _table(ctx, node, quantized)
    refs = ", ".join(ctx.ref(v) for v in (gp, scale, x))
    (gx,) = node.outputs
    call = (
        f"pe_qlinear_log_softmax_gather_grad_{_sfx(x)}({refs}, &w, {ctx.ref(index)}, "
        f"{_index_wide(index, node)}, {ctx.ref(lse)}, {ctx.ref(gx)}, {x.shape[0]}, {k}, "
        f"{vocab});"
    )
    return f"{{ {decl} {call} }}"


def _loss_with_grad(ctx: EmitContext, node: Node) -> str:
    head, quantized = split_inputs("linear_log_softmax_gather_with_grad", node.inputs)
    gp, scale, x, _, index = head
    decl, vocab, k = _table(ctx, node, quantized)
    refs = ", ".join(ctx.ref(v) for v in (gp, scale, x))
    outs = ", ".join(ctx.ref(v) for v in node.outputs)
    if not node.attrs.get("x_grad"):
        outs += ", NULL"
    call = (
        f"pe_qlinear_log_softmax_gather_with_grad_{_sfx(x)}({refs}, &w, {ctx.ref(index)}, "
        f"{_index_wide(index, node)}, {outs}, {x.shape[0]}, {k}, {vocab});"
    )
    return f"{{ {decl} {call} }}"


KERNELS["dequantize_linear_log_softmax_gather"] = _loss_forward
KERNELS["dequantize_linear_log_softmax_gather_grad"] = _loss_backward
KERNELS["dequantize_linear_log_softmax_gather_with_grad"] = _loss_with_grad
