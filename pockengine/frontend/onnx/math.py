"""ONNX converters: elementwise arithmetic, comparisons, activations, reductions, matmul."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pockengine.frontend.onnx.converters import (
    Ctx,
    Operand,
    const_ints,
    ir_dtype,
    norm_axis,
    onnx_op,
)
from pockengine.ir import CompileError, DType, Value

__all__ = ["Reduction", "reduce_axes", "reducer"]


def _operands(cx: Ctx, ins: list[Operand]) -> list[Value]:
    """The inputs as values of one dtype (the first computed input's; ONNX requires one)."""
    anchor = next((x for x in ins if isinstance(x, Value)), None)
    if anchor is None:  # all known (e.g. the branches of a Where on a computed condition)
        return [cx.value(x) for x in ins]
    return [cx.like(x, anchor) for x in ins]


def _binary(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        x, y = _operands(cx, ins)
        return cx.call(op, x, y)

    return convert


for _onnx, _ir in {
    "Add": "add",
    "Sub": "sub",
    "Mul": "mul",
    "Equal": "eq",
    "Less": "lt",
    "LessOrEqual": "le",
    "Greater": "gt",
    "GreaterOrEqual": "ge",
    "And": "logical_and",
    "Or": "logical_or",
    "Xor": "ne",
}.items():
    onnx_op(_onnx)(_binary(_ir))


@onnx_op("Div")
def _div(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x, y = _operands(cx, ins)
    if not x.dtype.is_float:
        raise CompileError(f"integer Div of {x.type} is not supported")
    return cx.call("div", x, y)


def _variadic(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        vals = _operands(cx, [x for x in ins if x is not None])
        out = vals[0]
        for v in vals[1:]:
            out = cx.call(op, out, v)
        return out

    return convert


onnx_op("Max")(_variadic("maximum"))
onnx_op("Min")(_variadic("minimum"))
onnx_op("Sum")(_variadic("add"))


@onnx_op("Mean")
def _mean_of(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    total = _variadic("add")(cx, ins, attrs)
    return cx.call("div", total, cx.full(float(len(ins)), total.dtype))


@onnx_op("Where")
def _where(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    cond = cx.cast(cx.value(ins[0]), DType.BOOL)
    x, y = _operands(cx, ins[1:])
    return cx.call("where", cond, x, y)


@onnx_op("Pow")
def _pow(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    """A constant scalar exponent is ``pow_scalar``; a computed one the float ``pow``."""
    base, exponent = ins
    if isinstance(exponent, np.ndarray) and exponent.size == 1:
        return cx.call("pow_scalar", cx.value(base), exponent=float(exponent.reshape(-1)[0]))
    x = cx.value(base)
    if not x.dtype.is_float:
        raise CompileError(f"Pow of {x.type} by a computed exponent: only float is supported")
    return cx.call("pow", x, cx.like(exponent, x))


_UNARY = {
    "Neg": "neg",
    "Exp": "exp",
    "Log": "log",
    "Sqrt": "sqrt",
    "Reciprocal": "reciprocal",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Relu": "relu",
    "Erf": "erf",
    "Sin": "sin",
    "Cos": "cos",
    "Abs": "abs",
    "Not": "logical_not",
}


def _unary(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        return cx.call(op, cx.value(ins[0]))

    return convert


for _onnx, _ir in _UNARY.items():
    onnx_op(_onnx)(_unary(_ir))


@onnx_op("Identity")
def _identity(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Operand:
    return ins[0]


@onnx_op("IsNaN")
def _isnan(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    return cx.call("ne", x, x)


@onnx_op("Gelu")
def _gelu(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    mode = attrs.get("approximate", "none")
    return cx.call("gelu", cx.value(ins[0]), approximate=mode)


@onnx_op("LeakyRelu")
def _leaky_relu(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    alpha = cx.full(float(attrs.get("alpha", 0.01)), x.dtype)
    positive = cx.call("gt", x, cx.full(0.0, x.dtype))
    return cx.call("where", positive, x, cx.call("mul", x, alpha))


def _hard_sigmoid(cx: Ctx, x: Value, alpha: float, beta: float) -> Value:
    lin = cx.call("add", cx.call("mul", x, cx.full(alpha, x.dtype)), cx.full(beta, x.dtype))
    return cx.call("clamp", lin, min=0.0, max=1.0)


@onnx_op("HardSigmoid")
def _hardsigmoid(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    return _hard_sigmoid(cx, cx.value(ins[0]), alpha, beta)


@onnx_op("HardSwish")
def _hardswish(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x = cx.value(ins[0])
    return cx.call("mul", x, _hard_sigmoid(cx, x, 1.0 / 6.0, 0.5))


def _bound(x: Operand, attr: Any) -> float | None:
    if x is None:
        return None if attr is None else float(attr)
    if not isinstance(x, np.ndarray):
        raise CompileError("Clip needs constant bounds")
    return float(x.reshape(-1)[0])


@onnx_op("Clip")
def _clip(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    ins = [*ins, None, None]
    low, high = _bound(ins[1], attrs.get("min")), _bound(ins[2], attrs.get("max"))
    x = cx.value(ins[0])
    if (low, high) == (0.0, 6.0):
        # torch's relu6 exports as Clip(0, 6); ATen passes its gradient strictly inside
        return cx.call("hardtanh", x, min_val=low, max_val=high)
    if not x.dtype.is_float:
        low = None if low is None else math.floor(low)
        high = None if high is None else math.floor(high)
    return cx.call("clamp", x, min=low, max=high)


@onnx_op("Cast")
def _cast(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    return cx.cast(cx.value(ins[0]), ir_dtype(int(attrs["to"]), "Cast"))


@onnx_op("CastLike")
def _cast_like(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Operand:
    x, target = ins
    dtype = target.dtype.to_numpy() if isinstance(target, Value) else np.asarray(target).dtype
    if isinstance(x, np.ndarray):
        return np.asarray(x, dtype=dtype)
    return cx.cast(cx.value(x), DType.from_numpy(dtype))


# -- softmax and reductions ----------------------------------------------------------------


def _softmax(op: str) -> Any:
    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        x = cx.value(ins[0])
        axis = norm_axis(int(attrs.get("axis", -1)), x.type.rank)
        if cx.opset < 13 and axis != x.type.rank - 1:
            raise CompileError(f"{op} before opset 13 flattens from axis {axis}: not supported")
        return cx.call(op, x, axis=axis)

    return convert


onnx_op("Softmax")(_softmax("softmax"))
onnx_op("LogSoftmax")(_softmax("log_softmax"))


def reduce_axes(ins: list[Operand], attrs: dict[str, Any], rank: int) -> tuple[int, ...] | None:
    """The axes of a Reduce* node (an input since opset 18, an attribute before); None when
    it reduces nothing (noop_with_empty_axes) and () for every axis."""
    given = ins[1] if len(ins) > 1 else None
    axes = const_ints(given, "axes") if given is not None else list(attrs.get("axes", []))
    if not axes:
        return None if attrs.get("noop_with_empty_axes", 0) else ()
    return tuple(sorted(norm_axis(int(a), rank) for a in axes))


Reduction = Callable[[Ctx, Value, tuple[int, ...] | None, bool], Value]


def reducer(body: Reduction) -> Any:
    """The converter of a Reduce* node: ``body(cx, x, axes, keepdims)`` over its axes
    (None: every axis); a node that reduces nothing passes its input through."""

    def convert(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
        x = cx.value(ins[0])
        axes = reduce_axes(ins, attrs, x.type.rank)
        if axes is None:
            return x
        return body(cx, x, axes or None, bool(attrs.get("keepdims", 1)))

    return convert


def _reduce(op: str) -> Any:
    return reducer(lambda cx, x, axes, keep: cx.call(op, x, axes=axes, keepdims=keep))


onnx_op("ReduceMean")(_reduce("mean"))
onnx_op("ReduceSum")(_reduce("sum"))
onnx_op("ReduceMax")(_reduce("amax"))


@onnx_op("CumSum")
def _cumsum(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise CompileError("CumSum with exclusive or reverse is not supported")
    x = cx.value(ins[0])
    axis = norm_axis(const_ints(ins[1], "CumSum axis")[0], x.type.rank)
    return cx.call("cumsum", x, axis=axis)


# -- matrix products -----------------------------------------------------------------------


def _matmul(cx: Ctx, x: Value, y: Value) -> Value:
    """np.matmul semantics: a 1-D operand gains, then loses, a unit axis."""
    xv = cx.call("reshape", x, shape=(1, x.shape[0])) if x.type.rank == 1 else x
    yv = cx.call("reshape", y, shape=(y.shape[0], 1)) if y.type.rank == 1 else y
    z = cx.call("matmul", xv, yv)
    if x.type.rank == 1 or y.type.rank == 1:
        keep = z.shape[:-2] + z.shape[-2:][x.type.rank == 1 : 2 - (y.type.rank == 1)]
        z = cx.call("reshape", z, shape=keep)
    return z


@onnx_op("MatMul")
def _matmul_op(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    x, y = _operands(cx, ins)
    return _matmul(cx, x, y)


def _t(cx: Ctx, v: Value) -> Value:
    return cx.call("transpose", v, perm=(1, 0))


@onnx_op("Gemm")
def _gemm(cx: Ctx, ins: list[Operand], attrs: dict[str, Any]) -> Value:
    """Y = alpha * A' @ B' + beta * C (torch's Linear: transB=1, alpha=beta=1)."""
    a, b = _operands(cx, ins[:2])
    a = _t(cx, a) if attrs.get("transA", 0) else a
    b = _t(cx, b) if attrs.get("transB", 0) else b
    y = cx.call("matmul", a, b)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if alpha != 1.0:
        y = cx.call("mul", y, cx.full(alpha, y.dtype))
    if len(ins) > 2 and ins[2] is not None and beta != 0.0:
        c = cx.like(ins[2], y)
        if beta != 1.0:
            c = cx.call("mul", c, cx.full(beta, y.dtype))
        y = cx.call("add", y, c)
    return y
