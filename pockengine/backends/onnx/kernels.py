"""ONNX kernels of the elementwise, reduction and update ops.

Each kernel receives the emitter, the IR node, the ONNX names of its inputs and the names
its results must take (for an effect: the ``<name>:new`` outputs of the values it writes),
and adds the ONNX nodes that compute them. The formulas follow the NumPy reference kernels
step by step so that float32 results agree to rounding.
"""

from __future__ import annotations

import math
from typing import Any

from pockengine.backends.onnx.emitter import Emitter, Kernel, onnx_dtype, registrar
from pockengine.ir import DType, Node, get_op
from pockengine.ops._common import norm_axes

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_kernel = registrar(KERNELS)


def _dtype(node: Node, i: int = 0) -> DType:
    return node.inputs[i].dtype


def _num(value: Any) -> float:
    if not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


# -- elementwise ---------------------------------------------------------------------

_BINARY = {
    "add": "Add",
    "sub": "Sub",
    "mul": "Mul",
    "div": "Div",
    "maximum": "Max",
    "minimum": "Min",
    "eq": "Equal",
    "lt": "Less",
    "le": "LessOrEqual",
    "gt": "Greater",
    "ge": "GreaterOrEqual",
    "logical_and": "And",
    "logical_or": "Or",
}
_UNARY = {
    "neg": "Neg",
    "exp": "Exp",
    "log": "Log",
    "sqrt": "Sqrt",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "relu": "Relu",
    "sin": "Sin",
    "cos": "Cos",
    "abs": "Abs",
    "reciprocal": "Reciprocal",
    "erf": "Erf",
    "logical_not": "Not",
}


def _same_op(onnx_op: str) -> Kernel:
    def emit(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
        em.op(onnx_op, *x, out=out[0])

    return emit


for _ir, _onnx_op in {**_BINARY, **_UNARY, "where": "Where"}.items():
    KERNELS[_ir] = _same_op(_onnx_op)


@_kernel("ne")
def _ne(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Not", em.op("Equal", *x), out=out[0])


@_kernel("rsqrt")
def _rsqrt(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Reciprocal", em.op("Sqrt", x[0]), out=out[0])


@_kernel("silu")
def _silu(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Mul", x[0], em.op("Sigmoid", x[0]), out=out[0])


@_kernel("relu_grad")
def _relu_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, y = x
    positive = em.op("Greater", y, em.scalar(0, _dtype(node, 1)))
    em.op("Where", positive, gz, em.scalar(0, _dtype(node)), out=out[0])


@_kernel("hardtanh_grad")
def _hardtanh_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, y = x
    dt = _dtype(node, 1)
    above = em.op("Greater", y, em.scalar(_num(node.attrs["min_val"]), dt))
    below = em.op("Less", y, em.scalar(_num(node.attrs["max_val"]), dt))
    em.op("Where", em.op("And", above, below), gz, em.scalar(0, _dtype(node)), out=out[0])


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_KAPPA = 0.044715


def _tanh_inner(em: Emitter, x: str, dt: DType) -> tuple[str, str]:
    """t = tanh(sqrt(2/pi) * (x + 0.044715 x^3)) and x^2."""
    x2 = em.op("Mul", x, x)
    cube = em.op("Mul", em.op("Mul", em.scalar(_KAPPA, dt), x2), x)
    inner = em.op("Mul", em.scalar(_SQRT_2_OVER_PI, dt), em.op("Add", x, cube))
    return em.op("Tanh", inner), x2


def _phi(em: Emitter, x: str, dt: DType) -> str:
    """The normal CDF 0.5 * (1 + erf(x / sqrt 2))."""
    erf = em.op("Erf", em.op("Mul", x, em.scalar(_INV_SQRT_2, dt)))
    return em.op("Mul", em.scalar(0.5, dt), em.op("Add", em.scalar(1.0, dt), erf))


@_kernel("gelu")
def _gelu(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    dt = _dtype(node)
    if node.attrs["approximate"] == "tanh":
        t, _ = _tanh_inner(em, x[0], dt)
        half = em.op("Mul", em.scalar(0.5, dt), x[0])
        em.op("Mul", half, em.op("Add", em.scalar(1.0, dt), t), out=out[0])
        return
    em.op("Mul", x[0], _phi(em, x[0], dt), out=out[0])


@_kernel("gelu_grad")
def _gelu_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, v = x
    dt = _dtype(node)
    if node.attrs["approximate"] == "tanh":
        t, x2 = _tanh_inner(em, v, dt)
        left = em.op("Mul", em.scalar(0.5, dt), em.op("Add", em.scalar(1.0, dt), t))
        sech2 = em.op("Sub", em.scalar(1.0, dt), em.op("Mul", t, t))
        slope = em.op("Add", em.scalar(1.0, dt), em.op("Mul", em.scalar(3 * _KAPPA, dt), x2))
        dinner = em.op("Mul", em.scalar(_SQRT_2_OVER_PI, dt), slope)
        right = em.op("Mul", em.op("Mul", em.op("Mul", em.scalar(0.5, dt), v), sech2), dinner)
        em.op("Mul", gz, em.op("Add", left, right), out=out[0])
        return
    gauss = em.op("Exp", em.op("Mul", em.op("Mul", em.scalar(-0.5, dt), v), v))
    pdf = em.op("Mul", gauss, em.scalar(_INV_SQRT_2PI, dt))
    em.op("Mul", gz, em.op("Add", _phi(em, v, dt), em.op("Mul", v, pdf)), out=out[0])


def _clip(em: Emitter, node: Node, x: str, low: Any, high: Any, out: str) -> None:
    dt = _dtype(node)
    lo = "" if low is None else em.scalar(_num(low), dt)
    hi = "" if high is None else em.scalar(_num(high), dt)
    if lo and hi and _num(low) > _num(high):
        lo = hi  # min > max gives max, as ATen
    em.op("Clip", x, lo, hi, out=out)


@_kernel("clamp")
def _clamp(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    _clip(em, node, x[0], node.attrs["min"], node.attrs["max"], out[0])


@_kernel("hardtanh")
def _hardtanh(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    _clip(em, node, x[0], node.attrs["min_val"], node.attrs["max_val"], out[0])


@_kernel("pow_scalar")
def _pow_scalar(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Pow", x[0], em.scalar(_num(node.attrs["exponent"]), _dtype(node)), out=out[0])


@_kernel("pow")
def _pow(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Pow", x[0], x[1], out=out[0])


@_kernel("log1p")
def _log1p(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    """ONNX has no Log1p; log(u) * x / (u - 1) with u = 1 + x (Goldberg's correction of
    the rounding in u), and x itself where u rounds to 1."""
    one = em.scalar(1, _dtype(node))
    u = em.op("Add", x[0], one)
    corrected = em.op("Div", em.op("Mul", em.op("Log", u), x[0]), em.op("Sub", u, one))
    em.op("Where", em.op("Equal", u, one), x[0], corrected, out=out[0])


@_kernel("cast")
def _cast(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Cast", x[0], out=out[0], to=onnx_dtype(str(node.attrs["dtype"])))


@_kernel("full")
def _full(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    import numpy as np

    v = node.output
    value = np.asarray(node.attrs["value"], dtype=v.dtype.to_numpy())
    if v.shape == ():
        em.op("Identity", em.const(value), out=out[0])
        return
    tensor = em.onnx.numpy_helper.from_array(value.reshape(1))
    em.op("ConstantOfShape", em.ints(v.shape), out=out[0], value=tensor)


@_kernel("arange")
def _arange(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    from pockengine.ir import get_op

    (values,) = get_op("arange").run([], node.attrs)
    em.op("Identity", em.const(values), out=out[0])


# -- reductions ----------------------------------------------------------------------


def _axes(node: Node) -> tuple[int, ...]:
    axes = node.attrs["axes"]
    return norm_axes(axes if isinstance(axes, tuple) else None, node.inputs[0].type.rank)


def _reduce(
    onnx_op: str, x: str, axes: tuple[int, ...], keepdims: bool, em: Emitter, out: str
) -> None:
    if not axes:  # a 0-d input: nothing to reduce
        em.op("Identity", x, out=out)
        return
    em.op(onnx_op, x, em.ints(axes), out=out, keepdims=int(keepdims))


@_kernel("sum")
def _sum(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    src = x[0]
    if _dtype(node) is DType.BOOL:
        src = em.op("Cast", src, to=onnx_dtype(DType.I64))
    _reduce("ReduceSum", src, _axes(node), bool(node.attrs["keepdims"]), em, out[0])


@_kernel("mean")
def _mean(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    _reduce("ReduceMean", x[0], _axes(node), bool(node.attrs["keepdims"]), em, out[0])


@_kernel("amax")
def _amax(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    _reduce("ReduceMax", x[0], _axes(node), bool(node.attrs["keepdims"]), em, out[0])


@_kernel("any")
def _any(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    nonzero = x[0]
    if _dtype(node) is not DType.BOOL:
        nonzero = em.op("Not", em.op("Equal", x[0], em.scalar(0, _dtype(node))))
    as_int = em.op("Cast", nonzero, to=onnx_dtype(DType.I32))
    reduced = em.tmp()
    _reduce("ReduceMax", as_int, _axes(node), bool(node.attrs["keepdims"]), em, reduced)
    em.op("Cast", reduced, out=out[0], to=onnx_dtype(DType.BOOL))


@_kernel("sum_to")
def _sum_to(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    src, shape = node.inputs[0].shape, node.output.shape
    lead = len(src) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and src[lead + i] != 1
    )
    if not axes:
        em.op("Reshape", x[0], em.ints(shape), out=out[0])
        return
    summed = em.op("ReduceSum", x[0], em.ints(axes), keepdims=1)
    em.op("Reshape", summed, em.ints(shape), out=out[0])


@_kernel("softmax")
def _softmax(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Softmax", x[0], out=out[0], axis=int(_num(node.attrs["axis"])))


@_kernel("safe_softmax")
def _safe_softmax(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    axis = int(_num(node.attrs["axis"]))
    dt = _dtype(node)
    top = em.op("ReduceMax", x[0], em.ints([axis]), keepdims=1)
    masked = em.op("IsInf", top, detect_positive=0)  # the slice is all -inf
    z = em.op("Softmax", em.op("Where", masked, em.scalar(0, dt), x[0]), axis=axis)
    em.op("Where", masked, em.scalar(0, dt), z, out=out[0])


@_kernel("softmax_grad")
def _softmax_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, y = x
    axis = int(_num(node.attrs["axis"]))
    dot = em.op("ReduceSum", em.op("Mul", gz, y), em.ints([axis]), keepdims=1)
    em.op("Mul", y, em.op("Sub", gz, dot), out=out[0])


@_kernel("log_softmax_grad")
def _log_softmax_grad(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    gz, z = x
    total = em.op("ReduceSum", gz, em.ints([int(_num(node.attrs["axis"]))]), keepdims=1)
    em.op("Sub", gz, em.op("Mul", em.op("Exp", z), total), out=out[0])


@_kernel("log_softmax")
def _log_softmax(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("LogSoftmax", x[0], out=out[0], axis=int(_num(node.attrs["axis"])))


@_kernel("cumsum")
def _cumsum(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    src = x[0]
    if _dtype(node) is DType.BOOL:
        src = em.op("Cast", src, to=onnx_dtype(DType.I64))
    em.op("CumSum", src, em.const(int(_num(node.attrs["axis"])), "i64"), out=out[0])


# -- updates: each writes the new values of what it mutates -----------------------------


def _rows(node: Node) -> int | None:
    rows = node.attrs.get("rows")
    return None if rows is None else int(_num(rows))


def _part(em: Emitter, w: str, rows: int | None) -> str:
    """The trained rows of w."""
    if rows is None:
        return w
    return em.op("Slice", w, em.ints([0]), em.ints([rows]), em.ints([0]))


def _write_rows(em: Emitter, node: Node, w: str, rows: int | None, new: str, out: str) -> None:
    if rows is None:
        em.op("Identity", new, out=out)
        return
    dim = node.inputs[0].shape[0]
    rest = em.op("Slice", w, em.ints([rows]), em.ints([dim]), em.ints([0]))
    em.op("Concat", new, rest, out=out, axis=0)


def _like_param(em: Emitter, node: Node, x: list[str], i: int) -> str:
    """Input i (the f32 learning rate or step count) in the param's dtype, as NumPy promotes."""
    if node.inputs[i].dtype is _dtype(node):
        return x[i]
    return em.op("Cast", x[i], to=onnx_dtype(_dtype(node)))


def _direction(em: Emitter, part: str, g: str, wd: float, dt: DType) -> str:
    """g + weight_decay * w."""
    if not wd:
        return g
    return em.op("Add", g, em.op("Mul", em.scalar(wd, dt), part))


# inputs of each effect before its optional ``skip`` flag
_ARITY = {"assign": 2, "sgd_update": 3, "sgd_momentum_update": 4, "adamw_update": 6}


def _gated(kernel: Kernel) -> Kernel:
    """An effect honouring its optional last input ``skip`` (1.0: a non-finite step): the
    kernel's new values go to temporaries, and each written output is
    ``Where(skip != 0, old, new)``, so a skipped step writes back what it read."""

    def gated(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
        if len(node.inputs) <= _ARITY[node.op]:
            kernel(em, node, x, out)
            return
        new = [em.tmp() for _ in out]
        kernel(em, node, x, new)
        skip = em.op("Cast", x[-1], to=onnx_dtype(DType.BOOL))
        for i, fresh, name in zip(get_op(node.op).mutates, new, out, strict=True):
            em.op("Where", skip, x[i], fresh, out=name)

    return gated


@_kernel("nonfinite")
def _nonfinite(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    bad = em.op("Or", em.op("IsNaN", x[0]), em.op("IsInf", x[0]))
    flag = em.op("Cast", bad, to=onnx_dtype(DType.F32))
    if node.inputs[0].shape == ():
        em.op("Identity", flag, out=out[0])
    else:
        em.op("ReduceMax", flag, out=out[0], keepdims=0)


@_kernel("assign")
@_gated
def _assign(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    em.op("Identity", x[1], out=out[0])


@_kernel("sgd_update")
@_gated
def _sgd(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    w, g, lr = x[0], x[1], _like_param(em, node, x, 2)
    dt, rows = _dtype(node), _rows(node)
    part = _part(em, w, rows)
    d = _direction(em, part, g, _num(node.attrs["weight_decay"]), dt)
    new = em.op("Sub", part, em.op("Mul", lr, d))
    _write_rows(em, node, w, rows, new, out[0])


@_kernel("sgd_momentum_update")
@_gated
def _sgd_momentum(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    w, g, buf, lr = *x[:3], _like_param(em, node, x, 3)
    dt, rows = _dtype(node), _rows(node)
    momentum = em.scalar(_num(node.attrs["momentum"]), dt)
    part = _part(em, w, rows)
    d = _direction(em, part, g, _num(node.attrs["weight_decay"]), dt)
    new_buf = em.op("Add", em.op("Mul", momentum, buf), d, out=out[1])
    step = new_buf
    if node.attrs["nesterov"]:
        step = em.op("Add", d, em.op("Mul", momentum, new_buf))
    new = em.op("Sub", part, em.op("Mul", lr, step))
    _write_rows(em, node, w, rows, new, out[0])


@_kernel("adamw_update")
@_gated
def _adamw(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    w, g, m, v = x[:4]
    t, lr = _like_param(em, node, x, 4), _like_param(em, node, x, 5)
    dt, rows = _dtype(node), _rows(node)
    b1, b2 = _num(node.attrs["beta1"]), _num(node.attrs["beta2"])
    one = em.scalar(1.0, dt)
    decay = em.op("Sub", one, em.op("Mul", lr, em.scalar(_num(node.attrs["weight_decay"]), dt)))
    part = em.op("Mul", _part(em, w, rows), decay)
    new_m = em.op(
        "Add",
        em.op("Mul", em.scalar(b1, dt), m),
        em.op("Mul", em.scalar(1 - b1, dt), g),
        out=out[1],
    )
    g2 = em.op("Mul", em.op("Mul", em.scalar(1 - b2, dt), g), g)
    new_v = em.op("Add", em.op("Mul", em.scalar(b2, dt), v), g2, out=out[2])
    bc1 = em.op("Sub", one, em.op("Pow", em.scalar(b1, dt), t))
    bc2 = em.op("Sub", one, em.op("Pow", em.scalar(b2, dt), t))
    denom = em.op("Div", em.op("Sqrt", new_v), em.op("Sqrt", bc2))
    denom = em.op("Add", denom, em.scalar(_num(node.attrs["eps"]), dt))
    step = em.op("Div", em.op("Mul", em.op("Div", lr, bc1), new_m), denom)
    _write_rows(em, node, w, rows, em.op("Sub", part, step), out[0])
