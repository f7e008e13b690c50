"""The flat converter table of the JAX frontend: jaxpr primitive name -> IR ops.

A converter receives a ``JCtx`` (the builder, the equation's params and result types,
its source) and the IR values of the equation's operands (literals arrive as 0-d
``full`` values), and returns the IR values of its results, one per jaxpr outvar.
Call-like primitives (``jit``, ``closed_call``, ``custom_jvp_call``, ...) have no
converter: the translator inlines their inner jaxpr (``inner_jaxpr``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pockengine.frontend.context import EmitContext, registrar
from pockengine.ir import CompileError, DType, GraphBuilder, TensorType, Value
from pockengine.ir.arrays import Array

__all__ = [
    "CONVERTERS",
    "INLINED",
    "NAMED_CALLS",
    "JCtx",
    "inner_jaxpr",
    "ir_dtype",
    "ir_type",
    "named_call",
    "norm_axes",
    "primitive",
]

Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}
# Call-like primitives and the param holding the jaxpr they call: inlined, never converted.
INLINED: dict[str, str] = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
# custom_jvp functions that are one IR op (whose VJP is the function's custom rule).
NAMED_CALLS: dict[str, str] = {"relu": "relu"}

_DTYPES = {
    "float32": DType.F32,
    "float64": DType.F64,
    "float16": DType.F16,
    "bfloat16": DType.BF16,
    "int32": DType.I32,
    "int64": DType.I64,
    "bool": DType.BOOL,
}


def ir_dtype(dtype: Any) -> DType:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise CompileError(f"dtype {name} is not supported (use float32, int32, int64 or bool)")
    return _DTYPES[name]


def ir_type(aval: Any) -> TensorType:
    """The IR type of a JAX abstract value (ShapedArray)."""
    return TensorType(tuple(int(d) for d in aval.shape), ir_dtype(aval.dtype))


def inner_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) that a call-like equation calls."""
    inner = eqn.params[INLINED[eqn.primitive.name]]
    if hasattr(inner, "jaxpr") and hasattr(inner, "consts"):  # ClosedJaxpr
        return inner.jaxpr, list(inner.consts)
    return inner, []


def named_call(eqn: Any) -> str | None:
    """The IR op of a ``custom_jvp_call`` of a function listed in NAMED_CALLS, else None."""
    if eqn.primitive.name != "custom_jvp_call":
        return None
    inner = eqn.params.get("call_jaxpr")
    info = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
    return NAMED_CALLS.get(str(getattr(info, "func_name", eqn.params.get("name", ""))))


def norm_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(int(a) % max(rank, 1) for a in axes)


class JCtx(EmitContext):
    """What converters use: the builder, the current equation and its source."""

    def __init__(self, b: GraphBuilder) -> None:
        super().__init__(b)
        self.params: dict[str, Any] = {}
        self.out_types: tuple[TensorType, ...] = ()
        self.known: dict[str, Array] = {}  # IR value name -> its value, when static

    @property
    def out_type(self) -> TensorType:
        return self.out_types[0]

    def reshape(self, v: Value, shape: tuple[int, ...]) -> Value:
        return v if v.shape == shape else self.call("reshape", v, shape=shape)

    def transpose(self, v: Value, perm: Sequence[int]) -> Value:
        perm = tuple(int(p) for p in perm)
        return v if perm == tuple(range(len(perm))) else self.call("transpose", v, perm=perm)

    def broadcast(self, v: Value, shape: tuple[int, ...]) -> Value:
        return v if v.shape == shape else self.call("broadcast_to", v, shape=shape)

    def static(self, v: Value, what: str) -> Array:
        """The value of an operand that must be known when compiling (slice starts, ...)."""
        if v.name not in self.known:
            raise CompileError(f"{what} must be static (computed from constants only)")
        return self.known[v.name]


# Registers one converter for the listed jaxpr primitives.
primitive = registrar(CONVERTERS)
