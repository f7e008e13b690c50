"""The torch kernel table, part one: creation, elementwise ops and reductions.

Each entry writes the statements of one node as source (see ``codegen``): a plain
call of an ATen kernel bound as a global (``aten_<name>``), attributes as literals. The
semantics are those of the op's NumPy reference kernel; where ATen differs, the entry
says how it is bridged (integer reductions keep their dtype, for one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pockengine.backends.torch import kernels_rng as torch_kernels_rng
from pockengine.backends.torch.codegen import Emit, Emitter, PairFinder, literal
from pockengine.ir import DType, get_op
from pockengine.ops._common import norm_axes

__all__ = ["FINDERS", "KERNELS", "NAMESPACE", "out_arg", "slot_copies", "to_slot", "torch_dtype"]

_aten = torch.ops.aten


# -- emitter factories ---------------------------------------------------------------------
def _target(e: Emit) -> str | None:
    """Where the result is written: over a dying input (``Emit.into``), else into its
    workspace slot (``Emit.dest``), else None (a fresh tensor)."""
    return e.into if e.into is not None else e.dest()


def out_arg(e: Emit, keyword: str = "out") -> str:
    """``, out=<target>`` when the result has a buffer to go to (``_target``)."""
    target = _target(e)
    return "" if target is None else f", {keyword}={target}"


def slot_copies(e: Emit) -> list[str]:
    """``r = to_slot(slot, r)`` for each result of the node that has a workspace slot
    (``Emit.dest``), for kernels whose ATen call allocates its results
    (``heap.COPIED_OPS``)."""
    stmts = []
    for k, (name, value) in enumerate(zip(e.outs, e.node.outputs, strict=True)):
        flat = e.dest((value.type.numel,), k)
        if flat is not None:
            stmts.append(f"{name} = to_slot({flat}, {name})")
    return stmts


def to_slot(slot: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` copied into ``slot`` (a flat tensor of as many elements) with the same
    strides, so that its views downstream stay views; ``result`` itself where its layout
    is not dense (a permutation of a row-major one), which ``slot`` could not hold."""
    if not _dense_layout(result):
        return result
    return slot.as_strided(result.shape, result.stride()).copy_(result)


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places (row-major up to an
    order of its axes)."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _call(fn: str, **kwargs: object) -> Emitter:
    """out = fn(*inputs, **kwargs), written over a dying input where allowed (``fn`` is a
    torch function taking ``out=``)."""
    extra = "".join(f", {k}={literal(v)}" for k, v in kwargs.items())

    def emit(e: Emit) -> list[str]:
        return [f"{e.out} = {fn}({', '.join(e.ins)}{extra}{out_arg(e)})"]

    return emit


def _grad_call(fn: str, e: Emit, args: str) -> str:
    """``fn(args)``, or its ``.grad_input`` overload (bound as ``fn_into``) writing over a
    dying input or into a workspace slot (``_target``)."""
    if _target(e) is None:
        return f"{e.out} = {fn}({args})"
    return f"{e.out} = {fn}_into({args}{out_arg(e, 'grad_input')})"


def _binary(fn: str, *, swap: bool = False, reverse: str | None = None) -> Emitter:
    """A binary ATen op taking a Scalar second operand: a 0-d ``full`` input is written as a
    literal. ``swap``: the op is commutative, so a scalar first operand moves second;
    ``reverse``: the op computing ``y fn x`` for a scalar first operand (rsub)."""

    def emit(e: Emit) -> list[str]:
        x, y = e.ins
        sx, sy = e.scalar(0), e.scalar(1)
        out = out_arg(e)
        if sy is not None and sx is None:
            return [f"{e.out} = {fn}({x}, {sy}{out})"]
        if sx is not None and sy is None and swap:
            return [f"{e.out} = {fn}({y}, {sx}{out})"]
        if sx is not None and sy is None and reverse and not out:
            # (``reverse`` takes no ``out=``; with one, fn's tensor overload below: x is 0-d)
            return [f"{e.out} = {reverse}({y}, {sx})"]
        return [f"{e.out} = {fn}({x}, {y}{out})"]

    return emit


# -- creation --------------------------------------------------------------------------------
def _full(e: Emit) -> list[str]:
    out = e.node.output
    scalar = torch.full((), e.attr("value"), dtype=_TORCH_DTYPES[out.dtype], device=e.device)
    k = e.const(scalar)
    return [f"{e.out} = {k}.expand({literal(out.shape)})" if out.shape else f"{e.out} = {k}"]


def _arange(e: Emit) -> list[str]:
    values = get_op("arange").kernel(**e.node.attrs)
    return [f"{e.out} = {e.const(_tensor(values, e.device))}"]


# -- elementwise -----------------------------------------------------------------------------
def _pow_scalar(e: Emit) -> list[str]:
    exponent = e.attr("exponent")
    x = e.node.inputs[0]
    # An integer tensor keeps its dtype only with an integer exponent (ATen promotes).
    value = exponent if x.dtype.is_float else int(exponent)
    return [f"{e.out} = aten_pow({e.ins[0]}, {literal(value)})"]


def _cast(e: Emit) -> list[str]:
    return [f"{e.out} = {e.ins[0]}.to({e.dtype(e.attr('dtype'))})"]


def _clamp(low_key: str, high_key: str) -> Emitter:
    def emit(e: Emit) -> list[str]:
        low, high = e.attr(low_key), e.attr(high_key)
        x = e.ins[0]
        if low is None and high is None:
            return [f"{e.out} = {x}.clone()"]
        bounds = f"{literal(low)}, {literal(high)}"
        dtype = e.node.inputs[0].dtype
        if not dtype.is_float and any(isinstance(b, float) for b in (low, high)):
            # float bounds promote; NumPy casts back
            return [f"{e.out} = aten_clamp({x}, {bounds}).to({e.dtype(dtype)})"]
        return [f"{e.out} = aten_clamp({x}, {bounds}{out_arg(e)})"]

    return emit


def _gelu(e: Emit) -> list[str]:
    approximate = literal(e.attr("approximate"))
    return [f"{e.out} = aten_gelu({e.ins[0]}, approximate={approximate}{out_arg(e)})"]


def _expanded(e: Emit) -> list[str]:
    """The operands of ``e`` expanded to its result's shape (for kernels that do not
    broadcast)."""
    shape = e.node.output.shape
    return [
        name if v.shape == shape else f"{name}.expand({literal(shape)})"
        for name, v in zip(e.ins, e.node.inputs, strict=True)
    ]


def _hardtanh_grad(e: Emit) -> list[str]:
    gz, y = _expanded(e)
    low, high = literal(e.attr("min_val")), literal(e.attr("max_val"))
    return [_grad_call("aten_hardtanh_backward", e, f"{gz}, {y}, {low}, {high}")]


def _relu_grad(e: Emit) -> list[str]:
    gz, y = e.ins
    return [_grad_call("aten_threshold_backward", e, f"{gz}, {y}, 0")]


def _gelu_grad(e: Emit) -> list[str]:
    # ATen's (oneDNN) gelu_backward does not broadcast: operands are expanded to the result.
    gz, x = _expanded(e)
    approximate = repr(e.attr("approximate"))
    return [_grad_call("aten_gelu_backward", e, f"{gz}, {x}, approximate={approximate}")]


def _where(e: Emit) -> list[str]:
    cond, x, y = e.ins
    sx, sy = e.scalar(1), e.scalar(2)
    if sx is None or sy is None:  # ATen's where takes one Scalar, not two
        x, y = sx or x, sy or y
    return [f"{e.out} = aten_where({cond}, {x}, {y})"]


# -- reductions ------------------------------------------------------------------------------
def _reduction(fn: str, *, typed: bool = False) -> Emitter:
    """fn(x, dims, keepdim); ``typed``: pass the result dtype (ATen widens int32 sums)."""

    def emit(e: Emit) -> list[str]:
        x = e.node.inputs[0]
        axes = norm_axes(e.attr("axes"), x.type.rank)
        keep = bool(e.attr("keepdims"))
        dtype = f", dtype={e.dtype(e.node.output.dtype)}" if typed else ""
        if len(axes) == x.type.rank and not keep:
            return [f"{e.out} = {fn}({e.ins[0]}{dtype})"]
        out = out_arg(e)  # a workspace slot (only sum is among ``WORKSPACE_OPS``)
        return [f"{e.out} = {fn}({e.ins[0]}, {literal(axes)}, {keep}{dtype}{out})"]

    return emit


def _sum_to(e: Emit) -> list[str]:
    x, shape = e.node.inputs[0], tuple(e.attr("shape"))
    lead = x.type.rank - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1
    )
    if not axes:
        return [f"{e.out} = {e.ins[0]}.reshape({literal(shape)})"]
    dtype = e.dtype(e.node.output.dtype)
    total = f"aten_sum({e.ins[0]}, {literal(axes)}, True, dtype={dtype})"
    return [f"{e.out} = {total}.reshape({literal(shape)})"]


def _softmax(fn: str) -> Emitter:
    def emit(e: Emit) -> list[str]:
        return [f"{e.out} = {fn}({e.ins[0]}, {e.attr('axis')})"]

    return emit


def _safe_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax, with 0 where a slice is all -inf: the mask comes from the (small) max over
    ``dim`` and is applied in place, two passes fewer than ATen's own _safe_softmax."""
    z = torch.softmax(x, dim)
    return z.masked_fill_(x.amax(dim, keepdim=True) == -math.inf, 0.0)


def _softmax_grad(e: Emit) -> list[str]:
    gz, y = e.ins
    dtype = e.dtype(e.node.output.dtype)
    return [f"{e.out} = aten_softmax_backward_data({gz}, {y}, {e.attr('axis')}, {dtype})"]


def _log_softmax_grad(e: Emit) -> list[str]:
    gz, z = e.ins
    dtype = e.dtype(e.node.output.dtype)
    return [f"{e.out} = aten_log_softmax_backward_data({gz}, {z}, {e.attr('axis')}, {dtype})"]


def _cumsum(e: Emit) -> list[str]:
    axis, dtype = e.attr("axis"), e.dtype(e.node.output.dtype)
    return [f"{e.out} = aten_cumsum({e.ins[0]}, {axis}, dtype={dtype})"]


# -- the table -------------------------------------------------------------------------------
_TORCH_DTYPES = {
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.F32: torch.float32,
    DType.F64: torch.float64,
    DType.I8: torch.int8,
    DType.U8: torch.uint8,
    DType.I32: torch.int32,
    DType.I64: torch.int64,
    DType.BOOL: torch.bool,
}


def torch_dtype(dtype: DType) -> torch.dtype:
    return _TORCH_DTYPES[dtype]


def _tensor(array: Any, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(array, order="C", copy=True)).to(device)


_UNARY = (
    *("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "sin", "cos", "abs"),
    *("reciprocal", "erf", "log1p"),
)
_PREDICATES = ("eq", "ne", "lt", "le", "gt", "ge")

KERNELS: dict[str, Emitter] = {
    "full": _full,
    "arange": _arange,
    **torch_kernels_rng.KERNELS,
    **{op: _call(f"aten_{op}") for op in _UNARY},
    "silu": _call("aten_silu"),
    "logical_not": _call("aten_logical_not"),
    "pow_scalar": _pow_scalar,
    "pow": _call("aten_pow"),
    "cast": _cast,
    "clamp": _clamp("min", "max"),
    "hardtanh": _clamp("min_val", "max_val"),
    "gelu": _gelu,
    "gelu_grad": _gelu_grad,
    "relu_grad": _relu_grad,
    "hardtanh_grad": _hardtanh_grad,
    "add": _binary("aten_add", swap=True),
    "mul": _binary("aten_mul", swap=True),
    "sub": _binary("aten_sub", reverse="aten_rsub"),
    "div": _binary("aten_div"),
    "maximum": _call("aten_maximum"),
    "minimum": _call("aten_minimum"),
    **{op: _binary(f"aten_{op}") for op in _PREDICATES},
    "ne": torch_kernels_rng.keep_or(_binary("aten_ne")),  # a fused dropout keep-mask
    "logical_and": _call("aten_logical_and"),
    "logical_or": _call("aten_logical_or"),
    "where": _where,
    "sum": _reduction("aten_sum", typed=True),
    "mean": _reduction("aten_mean"),
    "amax": _reduction("aten_amax"),
    "any": _reduction("aten_any"),
    "sum_to": _sum_to,
    "softmax": _softmax("aten_softmax"),
    "log_softmax": _softmax("aten_log_softmax"),
    "safe_softmax": _softmax("safe_softmax"),
    "softmax_grad": _softmax_grad,
    "log_softmax_grad": _log_softmax_grad,
    "cumsum": _cumsum,
}

_Fn = Callable[..., Any]
NAMESPACE: dict[str, _Fn] = {
    **{f"aten_{op}": getattr(torch, op) for op in (*_UNARY, *_PREDICATES)},
    "aten_silu": torch._C._nn.silu,
    "aten_logical_not": torch.logical_not,
    "safe_softmax": _safe_softmax,
    "aten_softmax_backward_data": torch.ops.aten._softmax_backward_data.default,
    "aten_log_softmax_backward_data": torch.ops.aten._log_softmax_backward_data.default,
    "aten_logical_and": torch.logical_and,
    "aten_logical_or": torch.logical_or,
    "aten_pow": torch.pow,
    "aten_clamp": torch.clamp,
    "aten_gelu": torch._C._nn.gelu,
    "aten_gelu_backward": _aten.gelu_backward.default,
    "aten_gelu_backward_into": _aten.gelu_backward.grad_input,
    "aten_threshold_backward": _aten.threshold_backward.default,
    "aten_threshold_backward_into": _aten.threshold_backward.grad_input,
    "aten_hardtanh_backward": _aten.hardtanh_backward.default,
    "aten_hardtanh_backward_into": _aten.hardtanh_backward.grad_input,
    "aten_add": torch.add,
    "aten_mul": torch.mul,
    "aten_sub": torch.sub,
    "aten_rsub": torch.rsub,
    "aten_div": torch.div,
    "aten_maximum": torch.maximum,
    "aten_minimum": torch.minimum,
    "aten_where": torch.where,
    "aten_sum": torch.sum,
    "aten_mean": torch.mean,
    "aten_amax": torch.amax,
    "aten_any": torch.any,
    "aten_softmax": torch.softmax,
    "aten_log_softmax": torch.log_softmax,
    "aten_cumsum": torch.cumsum,
    "to_slot": to_slot,
    **torch_kernels_rng.NAMESPACE,
}

FINDERS: dict[str, PairFinder] = dict(torch_kernels_rng.FINDERS)
