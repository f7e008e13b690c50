"""C lowerings of elementwise, creation, shape and reduction ops: generated loops.

Each lowering returns one C statement (a loop nest, or a brace block of a few) whose
shapes and strides are compile-time constants, so the compiler vectorises it. The math
of the float ops is an inline function of ``kernels/elementwise.h`` (``pe_gelu_f32``...);
integer and bool ops use C operators. Views (reshape, transpose, broadcast_to, slice)
are copies into the result's own planned buffer, as the memory plan counts them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pockengine.backends.c.emit import (
    CTYPES,
    CEmitError,
    EmitContext,
    Lowering,
    attr_float,
    attr_int,
    c_literal,
    merge_axes,
    strides,
)
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import DType, Node, Value

__all__ = ["KERNELS", "broadcast_strides", "index_access", "index_in_range", "indexed_loop"]

_FLOATS = (DType.F32, DType.F64)


def broadcast_strides(v: Value, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of ``v`` broadcast to ``shape`` (0 on stretched or added axes)."""
    own = strides(v.shape)
    lead = len(shape) - v.type.rank
    return tuple(
        0 if k < lead or v.shape[k - lead] == 1 else own[k - lead] for k in range(len(shape))
    )


def _map(ctx: EmitContext, node: Node, expr: Callable[[list[str]], str]) -> str:
    """out[i] = expr(inputs at i), inputs broadcast to the output's shape."""
    out = node.outputs[0]
    ops = [(ctx.ref(out), strides(out.shape))]
    ops += [(ctx.ref(v), broadcast_strides(v, out.shape)) for v in node.inputs]
    return ctx.loops(out.shape, ops, lambda r: f"{r[0]} = {expr(r[1:])}")


def _float_fn(name: str) -> Lowering:
    """A call of ``pe_<name>_<sfx>`` (kernels/elementwise.h) on the inputs."""

    def lower(ctx: EmitContext, node: Node) -> str:
        fn = f"pe_{name}_{_sfx(node.outputs[0])}"
        return _map(ctx, node, lambda r: f"{fn}({', '.join(r)})")

    return lower


def _libm(name: str) -> Lowering:
    """A <tgmath.h> function (float or double by its argument); float inputs only."""

    def lower(ctx: EmitContext, node: Node) -> str:
        _sfx(node.outputs[0])
        return _map(ctx, node, lambda r: f"{name}({r[0]})")

    return lower


def _operator(fmt: str, floats_only: bool = False) -> Lowering:
    def lower(ctx: EmitContext, node: Node) -> str:
        if floats_only:
            _sfx(node.inputs[0])
        if any(v.dtype is DType.BOOL for v in node.inputs) and fmt not in _BOOL_SAFE:
            raise CEmitError(f"{node.op} on bool")
        return _map(ctx, node, lambda r: fmt.format(*r))

    return lower


_BOOL_SAFE = {"({0} == {1})", "({0} != {1})", "({0} && {1})", "({0} || {1})", "!{0}"}


def _scalar_attr(node: Node, key: str) -> str:
    return c_literal(attr_float(node, key), node.outputs[0].dtype)


def _gelu(ctx: EmitContext, node: Node) -> str:
    fn, mode = f"pe_gelu_{_sfx(node.outputs[0])}", int(node.attrs["approximate"] == "tanh")
    return _map(ctx, node, lambda r: f"{fn}({r[0]}, {mode})")


def _gelu_grad(ctx: EmitContext, node: Node) -> str:
    fn, mode = f"pe_gelu_grad_{_sfx(node.outputs[0])}", int(node.attrs["approximate"] == "tanh")
    return _map(ctx, node, lambda r: f"{fn}({r[0]}, {r[1]}, {mode})")


def _clamp(ctx: EmitContext, node: Node) -> str:
    """clamp (min/max, each optional) and hardtanh (min_val/max_val)."""
    dtype = node.outputs[0].dtype
    keys = ("min_val", "max_val") if node.op == "hardtanh" else ("min", "max")
    low, high = (
        None if node.attrs.get(k) is None else c_literal(attr_float(node, k), dtype) for k in keys
    )

    def expr(r: list[str]) -> str:
        x = r[0]
        if low is not None:
            x = f"({x} < {low} ? {low} : {x})"
        if high is not None:
            x = f"({x} > {high} ? {high} : {x})"
        return x

    return _map(ctx, node, expr)


def _hardtanh_grad(ctx: EmitContext, node: Node) -> str:
    fn = f"pe_hardtanh_grad_{_sfx(node.outputs[0])}"
    lo, hi = _scalar_attr(node, "min_val"), _scalar_attr(node, "max_val")
    return _map(ctx, node, lambda r: f"{fn}({r[0]}, {r[1]}, {lo}, {hi})")


def _pow_scalar(ctx: EmitContext, node: Node) -> str:
    _sfx(node.outputs[0])
    e = _scalar_attr(node, "exponent")
    return _map(ctx, node, lambda r: f"pow({r[0]}, {e})")


def _cast(ctx: EmitContext, node: Node) -> str:
    out = node.outputs[0]
    if out.dtype is DType.BOOL:
        return _map(ctx, node, lambda r: f"({r[0]} != 0)")
    return _map(ctx, node, lambda r: f"({CTYPES[out.dtype]}){r[0]}")


def _where(ctx: EmitContext, node: Node) -> str:
    return _map(ctx, node, lambda r: f"({r[0]} ? {r[1]} : {r[2]})")


def _full(ctx: EmitContext, node: Node) -> str:
    out = node.outputs[0]
    value = c_literal(attr_float(node, "value"), out.dtype)
    return f"for (long i = 0; i < {out.type.numel}; i++) {ctx.ref(out)}[i] = {value};"


def _random_mask(ctx: EmitContext, node: Node) -> str:
    """Dropout's keep-mask from the counter-based hash of (seed, salt, flat index)."""
    seed, out = node.inputs[0], node.outputs[0]
    p, salt = attr_float(node, "p"), attr_int(node, "salt")
    scale = c_literal(float(np.float32(1.0 / (1.0 - p) if p < 1.0 else 0.0)), DType.F32)
    return (
        f"{{ uint64_t key = pe_mask_key({ctx.ref(seed)}[0], {salt}LL); "
        f"for (long i = 0; i < {out.type.numel}; i++) {{ "
        f"uint64_t h = pe_mix32(pe_mix32(key ^ ((uint64_t)i & 0xFFFFFFFFULL)) ^ "
        f"((uint64_t)i >> 32)); "
        f"{ctx.ref(out)}[i] = (double)h / 4294967296.0 >= {p!r} ? {scale} : 0.0f; }} }}"
    )


def _arange(ctx: EmitContext, node: Node) -> str:
    out = node.outputs[0]
    start, step = attr_float(node, "start"), attr_float(node, "step")
    if out.dtype in _FLOATS:
        value = f"({CTYPES[out.dtype]})({start!r} + {step!r} * (double)i)"
    else:
        value = f"({CTYPES[out.dtype]})({int(start)} + {int(step)} * i)"
    return f"for (long i = 0; i < {out.type.numel}; i++) {ctx.ref(out)}[i] = {value};"


def _copy(ctx: EmitContext, node: Node) -> str:
    """reshape, stop_gradient: the same elements in the result's buffer; nothing where the
    plan gave the result its input's buffer (``plan_step``)."""
    x, out = node.inputs[0], node.outputs[0]
    at: dict[str, int] = getattr(ctx.plan, "offsets", {})  # none in a claim probe
    if x.name in at and at.get(x.name) == at.get(out.name):
        return "(void)0; /* in place: the result has its input's buffer */"
    return f"memmove({ctx.ref(out)}, {ctx.ref(x)}, {out.type.nbytes});"


_TILE = 32  # a transpose's tile edge: a tile of each side stays in L1


def _transpose(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    perm = node.attrs["perm"]
    assert isinstance(perm, tuple)
    own = strides(x.shape)
    read = tuple(own[p] for p in perm)
    dims, (ws, rs) = merge_axes(out.shape, [strides(out.shape), read])
    if len(dims) == 2 and rs[-1] != 1 and min(dims) >= _TILE:
        return _tiled_transpose(ctx.ref(out), ctx.ref(x), dims, ws, rs)
    ops = [(ctx.ref(out), strides(out.shape)), (ctx.ref(x), read)]
    return ctx.loops(out.shape, ops, lambda r: f"{r[0]} = {r[1]}")


def _tiled_transpose(out: str, x: str, dims: list[int], ws: list[int], rs: list[int]) -> str:
    """A matrix transpose in square tiles: the strided reads of one tile share cache lines."""
    d0, d1 = dims
    return (
        f"for (long t0 = 0; t0 < {d0}; t0 += {_TILE}) "
        f"for (long t1 = 0; t1 < {d1}; t1 += {_TILE}) "
        f"for (long i0 = t0; i0 < (t0 + {_TILE} < {d0} ? t0 + {_TILE} : {d0}); i0++) "
        f"for (long i1 = t1; i1 < (t1 + {_TILE} < {d1} ? t1 + {_TILE} : {d1}); i1++) "
        f"{out}[i0 * {ws[0]} + i1 * {ws[1]}] = {x}[i0 * {rs[0]} + i1 * {rs[1]}];"
    )


def _slice_geometry(shape: tuple[int, ...], node: Node) -> tuple[int, int, int]:
    """(axis, first index, step) of a slice node over ``shape``."""
    axis = attr_int(node, "axis") % len(shape)
    start, stop, step = (attr_int(node, k) for k in ("start", "stop", "step"))
    first, _, stride = slice(start, stop, step).indices(shape[axis])
    return axis, first, stride


def _slice(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    axis, first, step = _slice_geometry(x.shape, node)
    own = list(strides(x.shape))
    base = first * own[axis]
    own[axis] *= step
    ops = [(ctx.ref(out), strides(out.shape)), (f"({ctx.ref(x)} + {base})", tuple(own))]
    return ctx.loops(out.shape, ops, lambda r: f"{r[0]} = {r[1]}")


def _slice_grad(ctx: EmitContext, node: Node) -> str:
    gz, out = node.inputs[0], node.outputs[0]
    axis, first, step = _slice_geometry(out.shape, node)
    own = list(strides(out.shape))
    base = first * own[axis]
    own[axis] *= step
    ops = [(f"({ctx.ref(out)} + {base})", tuple(own)), (ctx.ref(gz), strides(gz.shape))]
    scatter = ctx.loops(gz.shape, ops, lambda r: f"{r[0]} = {r[1]}")
    return f"{{ memset({ctx.ref(out)}, 0, {out.type.nbytes}); {scatter} }}"


def _concat(ctx: EmitContext, node: Node) -> str:
    out = node.outputs[0]
    axis = attr_int(node, "axis") % out.type.rank
    own, parts, offset = strides(out.shape), [], 0
    for x in node.inputs:
        ops = [(f"({ctx.ref(out)} + {offset * own[axis]})", own), (ctx.ref(x), strides(x.shape))]
        parts.append(ctx.loops(x.shape, ops, lambda r: f"{r[0]} = {r[1]}"))
        offset += x.shape[axis]
    return "{ " + " ".join(parts) + " }"


def _pad(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    pads = node.attrs["pads"]
    assert isinstance(pads, tuple)
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        raise CEmitError("negative padding")
    own = strides(out.shape)
    base = sum(lo * s for (lo, _), s in zip(pads, own, strict=True))
    fill = c_literal(attr_float(node, "value"), out.dtype)
    ops = [(f"({ctx.ref(out)} + {base})", own), (ctx.ref(x), strides(x.shape))]
    copy = ctx.loops(x.shape, ops, lambda r: f"{r[0]} = {r[1]}")
    return f"{{ for (long i = 0; i < {out.type.numel}; i++) {ctx.ref(out)}[i] = {fill}; {copy} }}"


def index_access(
    ctx: EmitContext, node: Node, target: tuple[int, ...], indices: list[Value]
) -> tuple[tuple[int, ...], str, str]:
    """The loop nest of advanced indexing ``x[..., i0, ..., i1, ...]`` over the result's
    shape: (result shape, loop header, element offset in ``x`` of shape ``target``)."""
    raw = node.attrs["axes"]
    assert isinstance(raw, tuple)
    axes = [int(a) % len(target) for a in raw]
    batch = tuple(int(d) for d in np.broadcast_shapes(*(v.shape for v in indices)))
    rest = [a for a in range(len(target)) if a not in axes]
    adjacent = axes[-1] - axes[0] == len(axes) - 1
    first = axes[0] if adjacent else 0
    shape = (
        (*target[: axes[0]], *batch, *target[axes[-1] + 1 :])
        if adjacent
        else (*batch, *(target[a] for a in rest))
    )
    place = {
        a: (a if a < first else a - len(axes) + len(batch)) if adjacent else len(batch) + k
        for k, a in enumerate(rest)
    }
    own = strides(target)
    terms = [f"o{place[a]} * {own[a]}" for a in rest]
    for a, v in zip(axes, indices, strict=True):
        pos = broadcast_strides(v, batch)
        at = " + ".join(f"o{first + d} * {s}" for d, s in enumerate(pos) if s) or "0"
        i = f"{ctx.ref(v)}[{at}]"
        terms.append(f"(({i}) < 0 ? ({i}) + {target[a]} : ({i})) * {own[a]}")
    header = "".join(f"for (long o{a} = 0; o{a} < {d}; o{a}++) " for a, d in enumerate(shape))
    return shape, header, " + ".join(terms) or "0"


def index_in_range(
    ctx: EmitContext, node: Node, target: tuple[int, ...], indices: list[Value]
) -> str:
    """The C condition that every index of ``index_access``'s loop nest, wrapped once as
    there, lies inside its axis of ``target``: outside, a read gives 0 and a write is
    skipped, so no index value reaches memory outside a tensor."""
    raw = node.attrs["axes"]
    assert isinstance(raw, tuple)
    axes = [int(a) % len(target) for a in raw]
    batch = tuple(int(d) for d in np.broadcast_shapes(*(v.shape for v in indices)))
    first = axes[0] if axes[-1] - axes[0] == len(axes) - 1 else 0
    conds = []
    for a, v in zip(axes, indices, strict=True):
        pos = broadcast_strides(v, batch)
        at = " + ".join(f"o{first + d} * {s}" for d, s in enumerate(pos) if s) or "0"
        i = f"{ctx.ref(v)}[{at}]"
        conds.append(f"(uint64_t)(({i}) < 0 ? ({i}) + {target[a]} : ({i})) < {target[a]}u")
    return " && ".join(conds) or "1"


def indexed_loop(
    ctx: EmitContext, node: Node, target: tuple[int, ...], indices: list[Value]
) -> tuple[str, str, str, str]:
    """The loop nest of advanced indexing into ``target`` (i64 indices only): (loop header,
    element offset in ``target``, the C condition that every index is in range, element
    offset in the result's shape). Shared by ``index``, ``index_grad`` and
    ``index_put_add``, so every index loop is guarded the same way."""
    for v in indices:
        if v.dtype is not DType.I64:
            raise CEmitError(f"index {v} is {v.dtype}; the C kernels take i64 indices")
    shape, header, offset = index_access(ctx, node, target, indices)
    inside = index_in_range(ctx, node, target, indices)
    flat = " + ".join(f"o{a} * {s}" for a, s in enumerate(strides(shape))) or "0"
    return header, offset, inside, flat


def _index(ctx: EmitContext, node: Node) -> str:
    x, *indices = node.inputs
    header, offset, inside, flat = indexed_loop(ctx, node, x.shape, indices)
    return f"{header}{ctx.ref(node.outputs[0])}[{flat}] = {inside} ? {ctx.ref(x)}[{offset}] : 0;"


def _index_grad(ctx: EmitContext, node: Node) -> str:
    gz, *indices = node.inputs
    out = node.outputs[0]
    _sfx(out)
    header, offset, inside, flat = indexed_loop(ctx, node, out.shape, indices)
    return (
        f"{{ memset({ctx.ref(out)}, 0, {out.type.nbytes}); "
        f"{header}if ({inside}) {ctx.ref(out)}[{offset}] += {ctx.ref(gz)}[{flat}]; }}"
    )


def _gather(ctx: EmitContext, node: Node) -> str:
    """torch.gather along ``axis``: z[o] = x[o with o[axis] replaced by index[o]], any dtype
    (0 for an index outside the axis: never a read outside ``x``)."""
    x, index = node.inputs
    if index.dtype is not DType.I64:
        raise CEmitError(f"index {index} is {index.dtype}; the C kernels take i64 indices")
    out = node.outputs[0]
    axis = attr_int(node, "axis") % index.type.rank
    own = strides(x.shape)
    flat = " + ".join(f"o{a} * {st}" for a, st in enumerate(strides(out.shape))) or "0"
    at = f"{ctx.ref(index)}[{flat}]"
    terms = [f"o{a} * {own[a]}" for a in range(x.type.rank) if a != axis]
    terms.append(f"{at} * {own[axis]}")
    header = "".join(f"for (long o{a} = 0; o{a} < {d}; o{a}++) " for a, d in enumerate(out.shape))
    read = f"((uint64_t){at} < {x.shape[axis]}u ? {ctx.ref(x)}[{' + '.join(terms)}] : 0)"
    return f"{header}{ctx.ref(out)}[{flat}] = {read};"


def _broadcast_to(ctx: EmitContext, node: Node) -> str:
    return _map(ctx, node, lambda r: r[0])


KERNELS: dict[str, Lowering] = {
    "neg": _operator("-{0}"),
    "abs": _operator("({0} < 0 ? -{0} : {0})"),
    "exp": _libm("exp"),
    "log": _libm("log"),
    "log1p": _libm("log1p"),
    "sqrt": _libm("sqrt"),
    "tanh": _libm("tanh"),
    "sin": _libm("sin"),
    "cos": _libm("cos"),
    "erf": _libm("erf"),
    "rsqrt": _float_fn("rsqrt"),
    "sigmoid": _float_fn("sigmoid"),
    "silu": _float_fn("silu"),
    "relu": _float_fn("relu"),
    "relu_grad": _float_fn("relu_grad"),
    "reciprocal": _operator("(1 / {0})", floats_only=True),
    "gelu": _gelu,
    "gelu_grad": _gelu_grad,
    "clamp": _clamp,
    "hardtanh": _clamp,
    "hardtanh_grad": _hardtanh_grad,
    "pow_scalar": _pow_scalar,
    "pow": _operator("pow({0}, {1})", floats_only=True),
    "cast": _cast,
    "add": _operator("{0} + {1}"),
    "sub": _operator("{0} - {1}"),
    "mul": _operator("{0} * {1}"),
    "div": _operator("{0} / {1}", floats_only=True),
    "maximum": _operator("({0} > {1} || {0} != {0} ? {0} : {1})", floats_only=True),
    "minimum": _operator("({0} < {1} || {0} != {0} ? {0} : {1})", floats_only=True),
    "eq": _operator("({0} == {1})"),
    "ne": _operator("({0} != {1})"),
    "lt": _operator("({0} < {1})"),
    "le": _operator("({0} <= {1})"),
    "gt": _operator("({0} > {1})"),
    "ge": _operator("({0} >= {1})"),
    "logical_and": _operator("({0} && {1})"),
    "logical_or": _operator("({0} || {1})"),
    "logical_not": _operator("!{0}"),
    "where": _where,
    "full": _full,
    "arange": _arange,
    "random_mask": _random_mask,
    "reshape": _copy,
    "stop_gradient": _copy,
    "transpose": _transpose,
    "broadcast_to": _broadcast_to,
    "slice": _slice,
    "slice_grad": _slice_grad,
    "concat": _concat,
    "pad": _pad,
    "index": _index,
    "gather": _gather,
    "index_grad": _index_grad,
}
