"""The flat converter table of the Keras frontend: TensorFlow op type -> IR ops.

A converter receives the translated data inputs of one TF graph node and its decoded
attributes, and returns the translation of each output it has. Operands are those of the ONNX
frontend (``frontend.operands.Operand``): an IR ``Value``, a NumPy array known at compile time (a
``Const``, a static shape, anything computed only from those) or None. The driver folds
every node whose inputs are all known, so converters always see at least one ``Value``.
``math``, ``shape`` and ``nn`` fill the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pockengine.frontend.context import const_ints, norm_axis, registrar
from pockengine.frontend.operands import Ctx, Operand
from pockengine.ir import CompileError, DType, Value

__all__ = [
    "TF_CONVERTERS",
    "Attrs",
    "Ctx",
    "Operand",
    "const_ints",
    "float_like",
    "ir_dtype",
    "norm_axis",
    "tf_op",
]

Attrs = dict[str, Any]
Converter = Callable[..., Any]
TF_CONVERTERS: dict[str, Converter] = {}

_DTYPES = {
    "float32": DType.F32,
    "float64": DType.F64,
    "int32": DType.I32,
    "int64": DType.I64,
    "bool": DType.BOOL,
}


def ir_dtype(name: str, what: str = "") -> DType:
    """The IR dtype of a TF dtype name ("float32"); float16/bfloat16 are refused."""
    if name not in _DTYPES:
        where = f" ({what})" if what else ""
        raise CompileError(
            f"TF dtype {name}{where} is not supported: use float32/64, int32/64 or bool "
            "(a mixed-precision policy must be float32 for training here)"
        )
    return _DTYPES[name]


def float_like(cx: Ctx, ins: Sequence[Operand]) -> list[Value]:
    """The operands as values of one dtype: that of the first computed operand."""
    anchor = next((x for x in ins if isinstance(x, Value)), None)
    if anchor is None:
        return [cx.value(x) for x in ins]
    return [cx.like(x, anchor) for x in ins]


# Registers one converter for the listed TF op types.
tf_op = registrar(TF_CONVERTERS)
