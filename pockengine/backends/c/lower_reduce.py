"""C lowerings of reductions (sum, sum_to, mean, amax, any) and of the softmax family.

A reduction is a loop nest with the kept axes outside and the reduced axes inside, in
memory order, accumulating each output element in double (int64 for integers and bools)
and storing it once; softmax, log-softmax and their backward kernels call
``kernels/softmax.c`` on the tensor seen as [outer, n, inner].
"""

from __future__ import annotations

import math

from pockengine.backends.c.emit import CTYPES, CEmitError, EmitContext, Lowering, strides
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import DType, Node, Value

__all__ = ["KERNELS"]


def _axes(node: Node, rank: int) -> tuple[int, ...]:
    axes = node.attrs.get("axes")
    if not axes:
        return tuple(range(rank))
    assert isinstance(axes, tuple)
    return tuple(sorted({int(a) % rank for a in axes}))


def _reduce(ctx: EmitContext, x: Value, out: Value, axes: tuple[int, ...], kind: str) -> str:
    """out = reduce(x over ``axes``) with ``kind`` in sum, mean, max, any."""
    own = strides(x.shape)
    kept = [a for a in range(x.type.rank) if a not in axes and x.shape[a] != 1]
    gone = [a for a in axes if x.shape[a] != 1]
    kept_sizes = [x.shape[a] for a in kept]
    out_strides = strides(tuple(kept_sizes))
    is_float = x.dtype in (DType.F32, DType.F64)
    acc_type = "double" if is_float else "int64_t"
    init = {"sum": "0", "mean": "0", "max": "-INFINITY", "any": "0"}[kind]
    if kind == "max" and not is_float:
        raise CEmitError("amax of integers")
    step = {
        "sum": "acc += {x};",
        "mean": "acc += {x};",
        "max": "acc = ({x} > acc || {x} != {x}) ? {x} : acc;",
        "any": "acc = acc || ({x} != 0);",
    }[kind]
    if kind in ("sum", "mean") and is_float and kept and gone and max(gone) < min(kept):
        rows, cols = math.prod(x.shape[a] for a in gone), math.prod(kept_sizes)
        return _column_sums(ctx.ref(x), ctx.ref(out), CTYPES[out.dtype], rows, cols, kind)
    index = " + ".join([f"j{a} * {own[a]}" for a in kept + gone]) or "0"
    text = step.format(x=f"{ctx.ref(x)}[{index}]")
    for a in reversed(gone):
        text = f"for (long j{a} = 0; j{a} < {x.shape[a]}; j{a}++) {text}"
    count = math.prod(x.shape[a] for a in gone)
    value = f"acc / {count}.0" if kind == "mean" else "acc"
    out_index = " + ".join(f"j{a} * {s}" for a, s in zip(kept, out_strides, strict=True)) or "0"
    text = (
        f"{{ {acc_type} acc = {init}; {text} "
        f"{ctx.ref(out)}[{out_index}] = ({CTYPES[out.dtype]})({value}); }}"
    )
    for a in reversed(kept):
        text = f"for (long j{a} = 0; j{a} < {x.shape[a]}; j{a}++) {text}"
    return text


_BLOCK = 2048  # columns summed at once: their double accumulators (16 KiB) stay in L1


def _column_sums(x: str, out: str, ctype: str, rows: int, cols: int, kind: str) -> str:
    """out[c] = sum over r of x[r, c] (mean: / rows) for x seen as [rows, cols]: a block of
    columns' double accumulators, the rows added in order, so each output sums in the same
    order as the strided loop (the same bits) while every row is read contiguously and the
    loop vectorises across columns (a bias gradient: [tokens, features] -> [features])."""
    value = f"acc[c] / {rows}.0" if kind == "mean" else "acc[c]"
    return (
        f"for (long c0 = 0; c0 < {cols}; c0 += {_BLOCK}) {{ "
        f"long w = {cols} - c0 < {_BLOCK} ? {cols} - c0 : {_BLOCK}; double acc[{_BLOCK}]; "
        f"for (long c = 0; c < w; c++) acc[c] = 0; "
        f"for (long r = 0; r < {rows}; r++) for (long c = 0; c < w; c++) "
        f"acc[c] += {x}[r * {cols} + c0 + c]; "
        f"for (long c = 0; c < w; c++) {out}[c0 + c] = ({ctype})({value}); }}"
    )


def _reduction(kind: str) -> Lowering:
    def lower(ctx: EmitContext, node: Node) -> str:
        x = node.inputs[0]
        return _reduce(ctx, x, node.outputs[0], _axes(node, x.type.rank), kind)

    return lower


def _sum_to(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    lead = x.type.rank - out.type.rank
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(out.shape) if d == 1 and x.shape[lead + i] != 1
    )
    return _reduce(ctx, x, out, axes, "sum")


def _split(shape: tuple[int, ...], axis: object) -> tuple[int, int, int]:
    """[outer, n, inner] around ``axis``."""
    if not isinstance(axis, int):
        raise CEmitError(f"axis {axis!r} is not an int")
    ax = axis % max(len(shape), 1)
    return math.prod(shape[:ax]), shape[ax] if shape else 1, math.prod(shape[ax + 1 :])


def _softmax(log: int, safe: int) -> Lowering:
    def lower(ctx: EmitContext, node: Node) -> str:
        x, out = node.inputs[0], node.outputs[0]
        o, n, i = _split(x.shape, node.attrs["axis"])
        return f"pe_softmax_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(out)}, {o}, {n}, {i}, {log}, {safe});"

    return lower


def _softmax_grad(log: int) -> Lowering:
    def lower(ctx: EmitContext, node: Node) -> str:
        gz, z = node.inputs
        o, n, i = _split(z.shape, node.attrs["axis"])
        out = ctx.ref(node.outputs[0])
        return (
            f"pe_softmax_grad_{_sfx(z)}({ctx.ref(gz)}, {ctx.ref(z)}, {out}, {o}, {n}, {i}, {log});"
        )

    return lower


def _nonfinite(ctx: EmitContext, node: Node) -> str:
    """skip = 1.0 when any element of x is NaN or infinite, else 0.0."""
    x, out = node.inputs[0], node.outputs[0]
    _sfx(x)
    return (
        f"{{ float flag = 0; for (long i = 0; i < {x.type.numel}; i++) "
        f"if (!isfinite({ctx.ref(x)}[i])) flag = 1; {ctx.ref(out)}[0] = flag; }}"
    )


def _cumsum(ctx: EmitContext, node: Node) -> str:
    """z[o, k, i] = z[o, k-1, i] + x[o, k, i] along the axis; bool sums to i64."""
    x, out = node.inputs[0], node.outputs[0]
    if x.dtype is DType.BOOL and out.dtype is not DType.I64:
        raise CEmitError(f"cumsum of bool into {out.dtype}")
    o, n, i = _split(x.shape, node.attrs["axis"])
    xs, zs, t = ctx.ref(x), ctx.ref(out), CTYPES[out.dtype]
    return (
        f"for (long a = 0; a < {o}; a++) for (long c = 0; c < {i}; c++) {{ "
        f"{t} acc = 0; for (long k = 0; k < {n}; k++) {{ "
        f"long at = (a * {n} + k) * {i} + c; acc += ({t}){xs}[at]; {zs}[at] = acc; }} }}"
    )


KERNELS: dict[str, Lowering] = {
    "nonfinite": _nonfinite,
    "cumsum": _cumsum,
    "sum": _reduction("sum"),
    "mean": _reduction("mean"),
    "amax": _reduction("max"),
    "any": _reduction("any"),
    "sum_to": _sum_to,
    "softmax": _softmax(0, 0),
    "safe_softmax": _softmax(0, 1),
    "log_softmax": _softmax(1, 0),
    "softmax_grad": _softmax_grad(0),
    "log_softmax_grad": _softmax_grad(1),
}
