"""The flat converter table of the ONNX frontend: ONNX op type -> IR ops.

A converter receives the translated inputs (``frontend.operands.Operand``: an IR
``Value``, a NumPy array known at compile time, or None for an absent optional input) and
the node's attributes, and returns the translation of each output. The driver folds every
node whose inputs are all known with ONNX's reference evaluator, so converters see at
least one ``Value``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pockengine.frontend.context import const_ints, norm_axis, registrar
from pockengine.frontend.operands import Ctx, Operand, sanitize
from pockengine.ir import CompileError, DType

__all__ = [
    "CONVERTERS",
    "Ctx",
    "Operand",
    "const_ints",
    "ir_dtype",
    "norm_axis",
    "onnx_op",
    "sanitize",
]

Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}

# TensorProto element types the IR has (float16 and bfloat16 models must be cast first).
_DTYPES = {1: DType.F32, 6: DType.I32, 7: DType.I64, 9: DType.BOOL, 11: DType.F64}


def ir_dtype(elem_type: int, what: str = "") -> DType:
    if elem_type not in _DTYPES:
        where = f" ({what})" if what else ""
        raise CompileError(
            f"ONNX element type {elem_type}{where} is not supported: use float32/64, int32/64 "
            "or bool"
        )
    return _DTYPES[elem_type]


# Registers one converter for the listed ONNX op types (default domain).
onnx_op = registrar(CONVERTERS)


def ints_attr(attrs: dict[str, Any], key: str, default: Sequence[int] | None = None) -> list[int]:
    value = attrs.get(key, default)
    if value is None:
        raise CompileError(f"attribute {key} is required")
    return [int(v) for v in value]
