"""C lowering of low-bit frozen weights: ``dequantize``, one call of ``kernels/quant.c``.

Codes are ``int8_t`` (int8) or packed ``uint8_t`` (4-bit); scales and offsets have the
result's type, or are GGUF's f16 (``uint16_t`` bits in C, converted per group by the
kernel; the result is then float32). f16 values are raw bits to the emitter: only
``dequantize``, which converts them, and ``index`` (an embedding's rows of the scales and
offsets, copied as they are) may read them (``HALF_OPS``), so no other op does arithmetic
on the bits.
"""

from __future__ import annotations

from pockengine.backends.c.emit import CEmitError, EmitContext, Lowering
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import DType, Node

__all__ = ["HALF_OPS", "KERNELS", "half_ok"]

HALF_OPS = frozenset(
    {"dequantize", "dequantize_matmul", "index"}
)  # the ops that may read or write f16 bits
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
