"""TF converters: elementwise arithmetic, activations, reductions, matrix products, einsum."""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.frontend import compose
from pockengine.frontend.keras.converters import (
    Attrs,
    Ctx,
    Operand,
    const_ints,
    float_like,
    ir_dtype,
    norm_axis,
    tf_op,
)
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


def _binary(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
        x, y = float_like(cx, ins)
        return cx.call(op, x, y)

    return convert


for _tf, _ir in {
    "Add": "add",
    "AddV2": "add",
    "Sub": "sub",
    "Mul": "mul",
    "Maximum": "maximum",
    "Minimum": "minimum",
    "Equal": "eq",
    "NotEqual": "ne",
    "Less": "lt",
    "LessEqual": "le",
    "Greater": "gt",
    "GreaterEqual": "ge",
    "LogicalAnd": "logical_and",
    "LogicalOr": "logical_or",
}.items():
    tf_op(_tf)(_binary(_ir))


@tf_op("RealDiv", "Div")
def _div(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x, y = float_like(cx, ins)
    if not x.dtype.is_float:
        raise CompileError(f"integer division of {x.type} is not supported")
    return cx.call("div", x, y)


@tf_op("SquaredDifference")
def _squared_difference(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x, y = float_like(cx, ins)
    d = cx.call("sub", x, y)
    return cx.call("mul", d, d)


@tf_op("Pow")
def _pow(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """A constant scalar exponent is ``pow_scalar``; a computed one the float ``pow``."""
    if isinstance(ins[1], np.ndarray) and np.asarray(ins[1]).size == 1:
        return cx.call("pow_scalar", cx.value(ins[0]), exponent=float(np.asarray(ins[1]).item()))
    x, y = float_like(cx, ins)
    if not x.dtype.is_float:
        raise CompileError(f"Pow of {x.type} by a computed exponent: only float is supported")
    return cx.call("pow", x, y)


@tf_op("ClipByValue")
def _clip_by_value(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """Constant scalar bounds are ``clamp``'s attributes; computed bounds are
    ``minimum(maximum(x, lo), hi)``, which TF's own gradient matches on ties."""
    x = cx.value(ins[0])
    lo, hi = ins[1], ins[2]
    if all(isinstance(b, np.ndarray) and b.size == 1 for b in (lo, hi)):
        bounds = [np.asarray(b).item() for b in (lo, hi)]
        return cx.call("clamp", x, min=bounds[0], max=bounds[1])
    x, lo_v, hi_v = float_like(cx, ins)
    return cx.call("minimum", cx.call("maximum", x, lo_v), hi_v)


@tf_op("SelectV2", "Select")
def _select(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    cond = cx.cast(cx.value(ins[0]), DType.BOOL)
    x, y = float_like(cx, ins[1:])
    return cx.call("where", cond, x, y)


def _unary(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
        return cx.call(op, cx.value(ins[0]))

    return convert


for _tf, _ir in {
    "Neg": "neg",
    "Exp": "exp",
    "Log": "log",
    "Log1p": "log1p",
    "Sqrt": "sqrt",
    "Rsqrt": "rsqrt",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Relu": "relu",
    "Abs": "abs",
    "Erf": "erf",
    "Sin": "sin",
    "Cos": "cos",
    "Reciprocal": "reciprocal",
    "Inv": "reciprocal",
    "LogicalNot": "logical_not",
}.items():
    tf_op(_tf)(_unary(_ir))


@tf_op("Identity")
def _identity(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Operand:
    return ins[0]


@tf_op("StopGradient")
def _stop_gradient(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    # Integers never get cotangents: nothing to stop.
    return cx.call("stop_gradient", x) if x.dtype.is_float else x


@tf_op("Square")
def _square(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    return cx.call("mul", x, x)


@tf_op("Erfc")
def _erfc(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """erfc(x) = 1 - erf(x) (Keras's exact GELU is 0.5 * x * erfc(-x / sqrt(2)))."""
    x = cx.value(ins[0])
    return cx.call("sub", cx.full(1.0, x.dtype), cx.call("erf", x))


@tf_op("Relu6")
def _relu6(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    """TF's Relu6Grad passes the gradient strictly inside (0, 6), as hardtanh's does."""
    return cx.call("hardtanh", cx.value(ins[0]), min_val=0.0, max_val=6.0)


@tf_op("LeakyRelu")
def _leaky_relu(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x = cx.value(ins[0])
    slope = cx.call("mul", x, cx.full(float(attrs.get("alpha", 0.2)), x.dtype))
    return cx.call("where", cx.call("gt", x, cx.full(0.0, x.dtype)), x, slope)


@tf_op("Cast")
def _cast(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return cx.cast(cx.value(ins[0]), ir_dtype(attrs["DstT"], "Cast"))


def _softmax(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
        x = cx.value(ins[0])
        return cx.call(op, x, axis=x.type.rank - 1)

    return convert


tf_op("Softmax")(_softmax("softmax"))
tf_op("LogSoftmax")(_softmax("log_softmax"))


def _reduce(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
        x = cx.value(ins[0])
        axes = tuple(sorted({norm_axis(a, x.type.rank) for a in const_ints(ins[1], "axes")}))
        if not axes:
            return x
        return cx.call(op, x, axes=axes, keepdims=bool(attrs.get("keep_dims", False)))

    return convert


tf_op("Mean")(_reduce("mean"))
tf_op("Sum")(_reduce("sum"))
tf_op("Max")(_reduce("amax"))


# -- matrix products ---------------------------------------------------------------------


def _swap_last(cx: Ctx, v: Value) -> Value:
    perm = (*range(v.type.rank - 2), v.type.rank - 1, v.type.rank - 2)
    return cx.call("transpose", v, perm=perm)


@tf_op("MatMul", "BatchMatMulV2", "BatchMatMulV3", "BatchMatMul")
def _matmul(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    x, y = float_like(cx, ins)
    if attrs.get("transpose_a") or attrs.get("adj_x"):
        x = _swap_last(cx, x)
    if attrs.get("transpose_b") or attrs.get("adj_y"):
        y = _swap_last(cx, y)
    return cx.call("matmul", x, y)


@tf_op("Einsum")
def _einsum(cx: Ctx, ins: list[Operand], attrs: Attrs) -> Value:
    return compose.einsum(cx, str(attrs["equation"]), float_like(cx, ins))
