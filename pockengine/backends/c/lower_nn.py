"""C lowerings of the kernel-library ops: matrix products, convolution, normalisation,
pooling, gather/embedding and the optimizer updates.

Each is one call of a ``kernels/*.c`` function (suffix ``_f32`` or ``_f64``); window ops
get their geometry as a static ``long`` array indexed by the ``PE_G_*`` names of
``pe_kernels.h``.
"""

from __future__ import annotations

import math

from pockengine.backends.c.conv_kernels import KERNEL_NAMES, candidates, conv_geometry, node_kernel
from pockengine.backends.c.emit import (
    CEmitError,
    EmitContext,
    Lowering,
    attr_float,
    attr_int,
    strides,
)
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.backends.c.workspace import WORK_KERNELS, workspace_of
from pockengine.ir import DType, Node, Value

__all__ = ["KERNELS"]


def _index(v: Value) -> None:
    if v.dtype is not DType.I64:
        raise CEmitError(f"index {v} is {v.dtype}; the C kernels take i64 indices")


def _batch_offsets(shape: tuple[int, ...], batch: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Element strides over the broadcast batch axes of an operand with matrix ``size``."""
    own = strides((*shape[:-2], 1))
    lead = len(batch) - (len(shape) - 2)
    return tuple(
        0 if k < lead or shape[k - lead] == 1 else own[k - lead] * size for k in range(len(batch))
    )


def _operand(ctx: EmitContext, v: Value) -> tuple[int, int]:
    """(leading dimension, transposed) of matrix operand ``v`` as the GEMM reads it: a view of
    a transpose (``views.py``) is read from its source's rows."""
    src = ctx.transposed(v)
    return (v.shape[-1], 0) if src is None else (src.shape[-1], 1)


def _matmul(ctx: EmitContext, node: Node) -> str:
    x, y = node.inputs
    out = node.outputs[0]
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    fn = f"pe_gemm_{_sfx(out)}"
    (lda, ta), (ldb, tb) = _operand(ctx, x), _operand(ctx, y)
    if y.type.rank == 2:  # x's batch axes fold into its rows
        rows = math.prod(x.shape[:-1])
        args = f"{ctx.ref(x)}, {lda}, {ta}, {ctx.ref(y)}, {ldb}, {tb}, {ctx.ref(out)}, {n}, 0"
        return f"{fn}({rows}, {n}, {k}, {args});"
    batch = out.shape[:-2]
    ops = [
        (ctx.ref(out), tuple(s * m * n for s in strides(batch))),
        (ctx.ref(x), _batch_offsets(x.shape, batch, m * k)),
        (ctx.ref(y), _batch_offsets(y.shape, batch, k * n)),
    ]

    def call(r: list[str]) -> str:
        z, a, b = (f"&{ref}" for ref in r)
        return f"{fn}({m}, {n}, {k}, {a}, {lda}, {ta}, {b}, {ldb}, {tb}, {z}, {n}, 0)"

    return ctx.loops(batch, ops, call)


def _linear(ctx: EmitContext, node: Node) -> str:
    x, w, b = node.inputs
    out = node.outputs[0]
    rows, k, n = math.prod(x.shape[:-1]), w.shape[0], w.shape[1]
    ldw, tw = _operand(ctx, w)
    z = ctx.ref(out)
    return (
        f"{{ pe_gemm_{_sfx(out)}({rows}, {n}, {k}, {ctx.ref(x)}, {k}, 0, {ctx.ref(w)}, {ldw}, "
        f"{tw}, {z}, {n}, 0); for (long i = 0; i < {rows}; i++) for (long j = 0; j < {n}; j++) "
        f"{z}[i * {n} + j] += {ctx.ref(b)}[j]; }}"
    )


def _pair(node: Node, key: str) -> tuple[int, int]:
    value = node.attrs[key]
    assert isinstance(value, tuple) and len(value) == 2
    return int(value[0]), int(value[1])


def _conv_call(ctx: EmitContext, node: Node, args: str) -> str:
    """The call of the node's chosen kernel (``ctx.conv_kernels``, else the rule) on
    ``args`` and the node's geometry array."""
    out = node.outputs[0]
    try:
        g = conv_geometry(node)
    except ValueError as exc:
        raise CEmitError(f"{node.op}: {exc}") from None
    names = ctx.conv_candidates.get(out.name) or candidates(node.op, g)
    left_out = set(candidates(node.op, g)) - set(names)  # by a budget (export_candidates)
    kernel = node_kernel(node, g, ctx.conv_kernels, without=left_out)
    if kernel not in names:
        raise CEmitError(f"{node.op}: kernel {kernel!r} cannot compute {out}")
    geom = ctx.longs("conv", g.longs())
    work = workspace_of(node)

    def call(name: str) -> str:
        if name not in WORK_KERNELS:
            return f"pe_{node.op}_{name}_{_sfx(out)}({args}, {geom});"
        if work is None:
            raise CEmitError(f"{node.op}: kernel {name!r} has no working memory for {out}")
        return f"pe_{node.op}_{name}_{_sfx(out)}({args}, {geom}, {ctx.ref(work)});"

    slot = ctx.conv_slots.get(out.name)
    if slot is None:
        return call(kernel)
    # the exported trainer: the kernel its table chose (conv_table.py), else the rule's for
    # the build it is made with (PE_FAST_GEMM, kernels/pe_isa.h)
    fast = node_kernel(node, g, ctx.conv_kernels, fast_gemm=True, without=left_out)
    others = [k for k in names if k != kernel]
    cases = " ".join(f"case {KERNEL_NAMES.index(k)}: {call(k)} break;" for k in others)
    rule = call(kernel)
    if fast != kernel:
        rule = f"\n#if PE_FAST_GEMM\n{call(fast)}\n#else\n{rule}\n#endif\n"
    return f"switch (pe_conv_choice[{slot}]) {{ {cases} default: {rule} }}"


def _conv2d(ctx: EmitContext, node: Node) -> str:
    x, w = node.inputs[:2]
    bias = ctx.ref(node.inputs[2]) if len(node.inputs) > 2 else "NULL"
    return _conv_call(ctx, node, f"{ctx.ref(x)}, {ctx.ref(w)}, {bias}, {ctx.ref(node.outputs[0])}")


def _conv2d_input_grad(ctx: EmitContext, node: Node) -> str:
    gy, w = node.inputs
    return _conv_call(ctx, node, f"{ctx.ref(gy)}, {ctx.ref(w)}, {ctx.ref(node.outputs[0])}")


def _conv2d_weight_grad(ctx: EmitContext, node: Node) -> str:
    x, gy = node.inputs
    return _conv_call(ctx, node, f"{ctx.ref(x)}, {ctx.ref(gy)}, {ctx.ref(node.outputs[0])}")


def _bn_dims(x: Value) -> str:
    return f"{x.shape[0]}, {x.shape[1]}, {math.prod(x.shape[2:])}"


def _batch_norm(ctx: EmitContext, node: Node) -> str:
    x, w, b = node.inputs
    y, mean, var = (ctx.ref(v) for v in node.outputs)
    eps = attr_float(node, "eps")
    args = f"{ctx.ref(x)}, {ctx.ref(w)}, {ctx.ref(b)}, {y}, {mean}, {var}, {_bn_dims(x)}, {eps!r}"
    return f"pe_batch_norm_{_sfx(x)}({args});"


def _batch_norm_grad(ctx: EmitContext, node: Node) -> str:
    gy, x, w, mean, var = (ctx.ref(v) for v in node.inputs)
    gx, gw, gb = ctx.ref_if_read(node.outputs[0]), *(ctx.ref(v) for v in node.outputs[1:])
    eps = attr_float(node, "eps")
    dims = _bn_dims(node.inputs[1])
    return (
        f"pe_batch_norm_grad_{_sfx(node.inputs[1])}({gy}, {x}, {w}, {mean}, {var}, {gx}, {gw}, "
        f"{gb}, {dims}, {eps!r});"
    )


def _clip_bounds(node: Node) -> str:
    return f"{attr_float(node, 'min_val')!r}, {attr_float(node, 'max_val')!r}"


def _batch_norm_hardtanh(ctx: EmitContext, node: Node) -> str:
    x, w, b = node.inputs
    z, mean, var = (ctx.ref(v) for v in node.outputs)
    eps = attr_float(node, "eps")
    args = f"{ctx.ref(x)}, {ctx.ref(w)}, {ctx.ref(b)}, {z}, {mean}, {var}, {_bn_dims(x)}, {eps!r}"
    return f"pe_batch_norm_hardtanh_{_sfx(x)}({args}, {_clip_bounds(node)});"


def _batch_norm_hardtanh_grad(ctx: EmitContext, node: Node) -> str:
    ins = ", ".join(ctx.ref(v) for v in node.inputs)
    gx = ctx.ref_if_read(node.outputs[0])  # the stem's, where its convolution takes no gradient
    outs = ", ".join([gx, *(ctx.ref(v) for v in node.outputs[1:])])
    dims = _bn_dims(node.inputs[1])
    eps = attr_float(node, "eps")
    return (
        f"pe_batch_norm_hardtanh_grad_{_sfx(node.inputs[1])}({ins}, {outs}, {dims}, {eps!r}, "
        f"{_clip_bounds(node)});"
    )


def _batch_norm_apply(ctx: EmitContext, node: Node) -> str:
    x = node.inputs[0]
    ins = ", ".join(ctx.ref(v) for v in node.inputs)
    eps = attr_float(node, "eps")
    clip = node.attrs.get("min_val") is not None
    bounds = _clip_bounds(node) if clip else "0.0, 0.0"
    return (
        f"pe_batch_norm_apply_{_sfx(x)}({ins}, {ctx.ref(node.outputs[0])}, {_bn_dims(x)}, "
        f"{eps!r}, {int(clip)}, {bounds});"
    )


def _ln_dims(x: Value, node: Node) -> str:
    ndim = attr_int(node, "ndim")
    return f"{math.prod(x.shape[: x.type.rank - ndim])}, {math.prod(x.shape[x.type.rank - ndim :])}"


def _layer_norm(ctx: EmitContext, node: Node) -> str:
    x, w, b = node.inputs
    y, mean, rstd = (ctx.ref(v) for v in node.outputs)
    eps = attr_float(node, "eps")
    return (
        f"pe_layer_norm_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(w)}, {ctx.ref(b)}, {y}, {mean}, {rstd}, "
        f"{_ln_dims(x, node)}, {eps!r});"
    )


def _layer_norm_grad(ctx: EmitContext, node: Node) -> str:
    gy, x, w, mean, rstd = (ctx.ref(v) for v in node.inputs)
    gx, gw, gb = (ctx.ref(v) for v in node.outputs)
    dims = _ln_dims(node.inputs[1], node)
    return (
        f"pe_layer_norm_grad_{_sfx(node.inputs[1])}({gy}, {x}, {w}, {mean}, {rstd}, {gx}, {gw}, "
        f"{gb}, {dims});"
    )


def _pool_geometry(ctx: EmitContext, node: Node, x: tuple[int, ...], y: tuple[int, ...]) -> str:
    (kh, kw), (sh, sw), (ph, pw) = (_pair(node, k) for k in ("kernel", "stride", "padding"))
    dh, dw = _pair(node, "dilation") if "dilation" in node.attrs else (1, 1)
    mode = int(bool(node.attrs.get("count_include_pad", False)))
    divisor = attr_int(node, "divisor_override", 0)
    planes = math.prod(x[:-2])
    g = [planes, 1, x[-2], x[-1], 1, kh, kw, y[-2], y[-1], sh, sw, ph, pw, dh, dw, 1, mode]
    return ctx.longs("pool", [*g, divisor])


def _max_pool(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    geom = _pool_geometry(ctx, node, x.shape, out.shape)
    return f"pe_max_pool2d_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(out)}, {geom});"


def _max_pool_grad(ctx: EmitContext, node: Node) -> str:
    gy, x = node.inputs
    geom = _pool_geometry(ctx, node, x.shape, gy.shape)
    out = ctx.ref(node.outputs[0])
    return f"pe_max_pool2d_grad_{_sfx(x)}({ctx.ref(gy)}, {ctx.ref(x)}, {out}, {geom});"


def _avg_pool(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    geom = _pool_geometry(ctx, node, x.shape, out.shape)
    return f"pe_avg_pool2d_{_sfx(x)}({ctx.ref(x)}, {ctx.ref(out)}, {geom});"


def _avg_pool_grad(ctx: EmitContext, node: Node) -> str:
    gy, out = node.inputs[0], node.outputs[0]
    geom = _pool_geometry(ctx, node, out.shape, gy.shape)
    return f"pe_avg_pool2d_grad_{_sfx(gy)}({ctx.ref(gy)}, {ctx.ref(out)}, {geom});"


def _gather_grad(ctx: EmitContext, node: Node) -> str:
    gz, index = node.inputs
    _index(index)
    out = node.outputs[0]
    axis = attr_int(node, "axis") % index.type.rank
    ishape, zshape = ctx.longs("shape", index.shape), ctx.longs("shape", out.shape)
    return (
        f"pe_gather_grad_{_sfx(gz)}({ctx.ref(gz)}, {ctx.ref(index)}, {ishape}, {zshape}, "
        f"{index.type.rank}, {axis}, {ctx.ref(out)});"
    )


def _embedding(ctx: EmitContext, node: Node) -> str:
    table, ids = node.inputs
    _index(ids)
    n, (rows, dim) = ids.type.numel, table.shape
    out = ctx.ref(node.outputs[0])
    args = f"{ctx.ref(table)}, {ctx.ref(ids)}, {n}, {dim}, {rows}, {out}"
    return f"pe_embedding_{_sfx(table)}({args});"


def _embedding_grad(ctx: EmitContext, node: Node) -> str:
    gz, ids = node.inputs
    _index(ids)
    rows = attr_int(node, "num_rows")
    pad = attr_int(node, "padding_idx", -(rows + 1))
    row = -1 if pad == -(rows + 1) else pad % rows
    n, dim, out = ids.type.numel, gz.shape[-1], ctx.ref(node.outputs[0])
    return (
        f"pe_embedding_grad_{_sfx(gz)}({ctx.ref(gz)}, {ctx.ref(ids)}, {n}, {dim}, {rows}, {row}, "
        f"{out});"
    )


def _head_strides(ctx: EmitContext, v: Value) -> list[int]:
    """Element strides of [B, H, rows, E] operand ``v`` over batch, head and row: its own,
    or its source's where it is a view of a [B, rows, H, E] tensor (``views.HEAD_PERM``)."""
    _, h, rows, e = v.shape
    if ctx.transposed(v) is None:
        return [h * rows * e, rows * e, e]
    return [rows * h * e, e, h * e]


def _attention_geometry(
    ctx: EmitContext, q: Value, k: Value, v: Value, mask: list[Value], go: Value | None = None
) -> str:
    """B, H, L, S, E, Ev, the mask's strides over [B, H, L, S] (0: broadcast), then the
    batch, head and row strides of q, k, v and the output gradient (the output's own in the
    forward)."""
    full = (*q.shape[:3], k.shape[2])
    strides4 = _bcast4(mask[0].shape, full) if mask else (0, 0, 0, 0)
    b, h, length, e = q.shape
    heads = [_head_strides(ctx, x) for x in (q, k, v)]
    ev = v.shape[3]
    heads.append(_head_strides(ctx, go) if go is not None else [h * length * ev, length * ev, ev])
    return ctx.longs(
        "attn", [b, h, length, k.shape[2], e, ev, *strides4, *(s for hs in heads for s in hs)]
    )


def _bcast4(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    own = strides(shape)
    lead = len(full) - len(shape)
    return tuple(0 if a < lead or shape[a - lead] == 1 else own[a - lead] for a in range(len(full)))


def _attention(ctx: EmitContext, node: Node) -> str:
    q, k, v, *mask = node.inputs
    out, lse = (ctx.ref(x) for x in node.outputs)
    geom = _attention_geometry(ctx, q, k, v, mask)
    m = ctx.ref(mask[0]) if mask else "NULL"
    scale, causal = attr_float(node, "scale"), int(bool(node.attrs["causal"]))
    return (
        f"pe_attention_{_sfx(q)}({ctx.ref(q)}, {ctx.ref(k)}, {ctx.ref(v)}, {m}, {out}, {lse}, "
        f"{geom}, {scale!r}, {causal});"
    )


def _attention_grad(ctx: EmitContext, node: Node) -> str:
    go, q, k, v, out, lse, *mask = node.inputs
    gq, gk, gv = (ctx.ref(x) for x in node.outputs)
    geom = _attention_geometry(ctx, q, k, v, mask, go)
    m = ctx.ref(mask[0]) if mask else "NULL"
    scale, causal = attr_float(node, "scale"), int(bool(node.attrs["causal"]))
    ins = ", ".join(ctx.ref(x) for x in (go, q, k, v))
    return (
        f"pe_attention_grad_{_sfx(q)}({ins}, {m}, {ctx.ref(out)}, {ctx.ref(lse)}, {gq}, {gk}, "
        f"{gv}, {geom}, {scale!r}, {causal});"
    )


def _guarded(ctx: EmitContext, node: Node, arity: int, statement: str) -> str:
    """``statement`` unless the optional ``skip`` input (after the first ``arity``) is set:
    a step whose loss is not finite writes nothing."""
    if len(node.inputs) <= arity:
        return statement
    return f"if ({ctx.ref(node.inputs[arity])}[0] == 0) {statement}"


def _assign(ctx: EmitContext, node: Node) -> str:
    dst, src = node.inputs[:2]
    if dst.type != src.type:
        raise CEmitError(f"assign of {src.type} to {dst.type}")
    return _guarded(ctx, node, 2, f"memmove({ctx.ref(dst)}, {ctx.ref(src)}, {dst.type.nbytes});")


def _num(node: Node, key: str) -> str:
    return repr(attr_float(node, key))


def _sgd(ctx: EmitContext, node: Node) -> str:
    w, g, lr = node.inputs[:3]
    return _guarded(
        ctx,
        node,
        3,
        f"pe_sgd_{_sfx(w)}({ctx.ref(w)}, {ctx.ref(g)}, (double){ctx.ref(lr)}[0], "
        f"{g.type.numel}, {_num(node, 'weight_decay')});",
    )


def _sgd_momentum(ctx: EmitContext, node: Node) -> str:
    w, g, buf, lr = node.inputs[:4]
    nesterov = int(bool(node.attrs["nesterov"]))
    return _guarded(
        ctx,
        node,
        4,
        f"pe_sgd_momentum_{_sfx(w)}({ctx.ref(w)}, {ctx.ref(g)}, {ctx.ref(buf)}, "
        f"(double){ctx.ref(lr)}[0], {g.type.numel}, {_num(node, 'momentum')}, "
        f"{_num(node, 'weight_decay')}, {nesterov});",
    )


def _adamw(ctx: EmitContext, node: Node) -> str:
    w, g, m, v, t, lr = node.inputs[:6]
    hyper = ", ".join(_num(node, k) for k in ("beta1", "beta2", "eps", "weight_decay"))
    return _guarded(
        ctx,
        node,
        6,
        f"pe_adamw_{_sfx(w)}({ctx.ref(w)}, {ctx.ref(g)}, {ctx.ref(m)}, {ctx.ref(v)}, "
        f"(double){ctx.ref(t)}[0], (double){ctx.ref(lr)}[0], {g.type.numel}, {hyper});",
    )


def _adamw8bit(ctx: EmitContext, node: Node) -> str:
    """One ``pe_adamw8bit`` call over the trained elements (``rows``: the first rows)."""
    w, g, mq, ma, vq, va, t, lr = node.inputs[:8]
    hyper = ", ".join(_num(node, k) for k in ("beta1", "beta2", "eps", "weight_decay"))
    state = ", ".join(ctx.ref(v) for v in (w, g, mq, ma, vq, va))
    return _guarded(
        ctx,
        node,
        8,
        f"pe_adamw8bit_{_sfx(w)}({state}, (double){ctx.ref(t)}[0], (double){ctx.ref(lr)}[0], "
        f"{g.type.numel}, {attr_int(node, 'block')}, {hyper});",
    )


KERNELS: dict[str, Lowering] = {
    "matmul": _matmul,
    "linear": _linear,
    "conv2d": _conv2d,
    "conv2d_input_grad": _conv2d_input_grad,
    "conv2d_weight_grad": _conv2d_weight_grad,
    "batch_norm": _batch_norm,
    "batch_norm_grad": _batch_norm_grad,
    "batch_norm_hardtanh": _batch_norm_hardtanh,
    "batch_norm_apply": _batch_norm_apply,
    "batch_norm_hardtanh_grad": _batch_norm_hardtanh_grad,
    "layer_norm": _layer_norm,
    "layer_norm_grad": _layer_norm_grad,
    "max_pool2d": _max_pool,
    "max_pool2d_grad": _max_pool_grad,
    "avg_pool2d": _avg_pool,
    "avg_pool2d_grad": _avg_pool_grad,
    "gather_grad": _gather_grad,
    "embedding": _embedding,
    "embedding_grad": _embedding_grad,
    "attention": _attention,
    "attention_grad": _attention_grad,
    "assign": _assign,
    "sgd_update": _sgd,
    "sgd_momentum_update": _sgd_momentum,
    "adamw_update": _adamw,
    "adamw8bit_update": _adamw8bit,
}
