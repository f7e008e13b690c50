"""Frontend-neutral compositions of IR ops that several frontends share: resizing along
one axis (nearest and linear), repeating, tiling, flipping and splitting an axis, ELU,
softplus and softsign, einsum, group normalisation, and the transposed convolution.

Each takes an ``EmitContext`` (every frontend's converter context), so the ATen, TF and
ONNX converters of one operation emit the same nodes. Resizing reads source positions
by index (``index``, whose gradient scatters back); a whole-number upscale repeats and a
whole-number downscale strides, which need no index at all.
"""

from __future__ import annotations

import numpy as np

from pockengine.frontend.context import EmitContext
from pockengine.ir import CompileError, DType, Value

__all__ = [
    "amin",
    "arg_extreme",
    "einsum",
    "elu",
    "flip_axis",
    "group_normalise",
    "l2_norm",
    "linear_axis",
    "nearest_axis",
    "repeat_axis",
    "softplus",
    "softsign",
    "split_axis",
    "tile_axis",
    "transposed_conv2d",
]


def repeat_axis(cx: EmitContext, x: Value, axis: int, k: int) -> Value:
    """Every element along ``axis`` repeated ``k`` times in place: [a, b] -> [a, a, b, b]."""
    shape = x.shape
    y = cx.call("reshape", x, shape=(*shape[: axis + 1], 1, *shape[axis + 1 :]))
    y = cx.call("broadcast_to", y, shape=(*shape[: axis + 1], k, *shape[axis + 1 :]))
    return cx.call("reshape", y, shape=(*shape[:axis], shape[axis] * k, *shape[axis + 1 :]))


def tile_axis(cx: EmitContext, x: Value, axis: int, k: int) -> Value:
    """``axis`` repeated ``k`` times whole: [a, b] -> [a, b, a, b]."""
    shape = x.shape
    y = cx.call("reshape", x, shape=(*shape[:axis], 1, *shape[axis:]))
    y = cx.call("broadcast_to", y, shape=(*shape[:axis], k, *shape[axis:]))
    return cx.call("reshape", y, shape=(*shape[:axis], shape[axis] * k, *shape[axis + 1 :]))


def nearest_axis(
    cx: EmitContext, x: Value, axis: int, size: int, ratio: float, half: bool
) -> Value:
    """Nearest resizing of ``axis`` to ``size``: source floor((i [+ 0.5 if half]) * ratio),
    clipped, computed in float32 (as ATen's and TF's kernels)."""
    n = x.shape[axis]
    step = np.float32(ratio)
    pos = np.arange(size, dtype=np.float32) + np.float32(0.5 if half else 0.0)
    src = np.minimum(np.floor(pos * step).astype(np.int64), n - 1)
    if size == n and np.array_equal(src, np.arange(n)):
        return x
    if size % n == 0 and np.array_equal(src, np.arange(size) // (size // n)):
        return repeat_axis(cx, x, axis, size // n)
    k = n // size if size else 0
    if k and np.array_equal(src, np.arange(size) * k + src[0]):
        return cx.call("slice", x, axis=axis, start=int(src[0]), stop=int(src[-1]) + 1, step=k)
    index = _positions(cx, size, 0.5 if half else 0.0)
    index = cx.cast(cx.call("mul", index, cx.full(float(step), DType.F32)), DType.I64)
    index = cx.call("minimum", index, cx.full(n - 1, DType.I64))
    return cx.call("index", x, index, axes=(axis,))


def _positions(cx: EmitContext, size: int, offset: float) -> Value:
    pos = cx.call("arange", start=0, stop=size, step=1, dtype="f32")
    return cx.call("add", pos, cx.full(offset, DType.F32)) if offset else pos


def linear_axis(cx: EmitContext, x: Value, axis: int, size: int, ratio: float, mode: str) -> Value:
    """Linear resizing of ``axis`` to ``size``: x[i0] + (x[i1] - x[i0]) * t at source
    position s = i * ratio (``mode`` "align" or "asymmetric") or (i + 0.5) * ratio - 0.5
    clipped at 0 ("half": ATen's align_corners=False, TF's half_pixel_centers)."""
    n = x.shape[axis]
    if mode not in ("align", "asymmetric", "half"):
        raise CompileError(f"linear resizing mode {mode!r} is not supported")
    if size == n and (mode == "align" or ratio == 1.0):
        return x
    src = cx.call(
        "mul",
        _positions(cx, size, 0.5 if mode == "half" else 0.0),
        cx.full(float(ratio), DType.F32),
    )
    if mode == "half":
        src = cx.call("sub", src, cx.full(0.5, DType.F32))
        src = cx.call("maximum", src, cx.full(0.0, DType.F32))
    last = cx.full(n - 1, DType.I64)
    lo = cx.call("minimum", cx.cast(src, DType.I64), last)
    hi = cx.call("minimum", cx.call("add", lo, cx.full(1, DType.I64)), last)
    frac = cx.call("sub", src, cx.cast(lo, DType.F32))
    shape = tuple(size if i == axis else 1 for i in range(x.type.rank))
    frac = cx.cast(cx.call("reshape", frac, shape=shape), x.dtype)
    low = cx.call("index", x, lo, axes=(axis,))
    high = cx.call("index", x, hi, axes=(axis,))
    return cx.call("add", low, cx.call("mul", cx.call("sub", high, low), frac))


def elu(
    cx: EmitContext, x: Value, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> Value:
    """scale * x where x > 0, else scale * alpha * (exp(input_scale * x) - 1). The
    exponential reads min(x, 0), so a large x never makes inf (whose gradient through the
    unselected branch would be 0 * inf = NaN). SELU and CELU are ELUs too."""
    zero = cx.full(0.0, x.dtype)
    neg = cx.call("mul", cx.call("minimum", x, zero), cx.full(float(input_scale), x.dtype))
    low = cx.call("sub", cx.call("exp", neg), cx.full(1.0, x.dtype))
    low = cx.call("mul", low, cx.full(float(alpha) * float(scale), x.dtype))
    high = x if scale == 1 else cx.call("mul", x, cx.full(float(scale), x.dtype))
    return cx.call("where", cx.call("gt", x, zero), high, low)


Pair = tuple[int, int]


def transposed_conv2d(
    cx: EmitContext,
    x: Value,
    w: Value,
    out_shape: tuple[int, ...],
    stride: Pair,
    pads: tuple[Pair, Pair],
    dilation: Pair,
    groups: int,
) -> Value:
    """A transposed convolution, NCHW: the input gradient of the convolution it
    transposes (``w`` that convolution's OIHW weight: [C_in of x, C_out / groups, kh, kw])
    at ``out_shape``. ``pads`` ((top, left), (bottom, right)) are that convolution's:
    unequal sides are made on a padded shape and cut off; a negative one (an output
    larger than any input reaches, e.g. ONNX's ``output_shape``) is zeros padded on."""
    (bh, bw), (eh, ew) = pads
    if (bh, bw) == (eh, ew) and min(bh, bw) >= 0:
        return cx.call(
            "conv2d_input_grad",
            x,
            w,
            x_shape=tuple(out_shape),
            stride=stride,
            padding=(bh, bw),
            dilation=dilation,
            groups=groups,
        )
    n, c, h, wd = out_shape
    padded = (n, c, h + bh + eh, wd + bw + ew)  # the natural output of zero padding
    y = cx.call(
        "conv2d_input_grad",
        x,
        w,
        x_shape=padded,
        stride=stride,
        padding=(0, 0),
        dilation=dilation,
        groups=groups,
    )
    if min(bh, bw, eh, ew) < 0:
        grow = ((0, 0), (0, 0), (max(-bh, 0), max(-eh, 0)), (max(-bw, 0), max(-ew, 0)))
        y = cx.call("pad", y, pads=grow, value=0.0)
        bh, bw = max(bh, 0), max(bw, 0)
    y = cx.call("slice", y, axis=2, start=bh, stop=bh + h, step=1)
    return cx.call("slice", y, axis=3, start=bw, stop=bw + wd, step=1)


def flip_axis(cx: EmitContext, x: Value, axis: int) -> Value:
    """``axis`` read backwards: an index of n-1 .. 0 (its gradient flips back)."""
    n = x.shape[axis]
    if n < 2:
        return x
    order = cx.call("arange", start=n - 1, stop=-1, step=-1, dtype="i64")
    return cx.call("index", x, order, axes=(axis,))


def split_axis(cx: EmitContext, x: Value, axis: int, sizes: list[int]) -> list[Value]:
    """Consecutive slices of ``axis`` with the given sizes."""
    if sum(sizes) != x.shape[axis]:
        raise CompileError(f"split sizes {sizes} do not add up to axis {axis} of {x.type}")
    parts, start = [], 0
    for size in sizes:
        parts.append(cx.call("slice", x, axis=axis, start=start, stop=start + size, step=1))
        start += size
    return parts


def softplus(cx: EmitContext, x: Value) -> Value:
    """log(1 + exp(x)), as ATen computes it: x itself above 20; the exponential reads
    min(x, 20), so the unselected branch never overflows into a NaN gradient."""
    limit = cx.full(20.0, x.dtype)
    soft = cx.call("log1p", cx.call("exp", cx.call("minimum", x, limit)))
    return cx.call("where", cx.call("gt", x, limit), x, soft)


def softsign(cx: EmitContext, x: Value) -> Value:
    """x / (1 + |x|)."""
    return cx.call("div", x, cx.call("add", cx.call("abs", x), cx.full(1.0, x.dtype)))


def _arrange(cx: EmitContext, v: Value, letters: str, order: str) -> Value:
    perm = tuple(letters.index(c) for c in order)
    return v if perm == tuple(range(len(perm))) else cx.call("transpose", v, perm=perm)


def _reshape(cx: EmitContext, v: Value, shape: tuple[int, ...]) -> Value:
    return v if v.shape == shape else cx.call("reshape", v, shape=shape)


def _spelled(equation: str, operands: list[Value]) -> tuple[list[str], str]:
    """The equation's operand and output subscripts with '...' spelled out as capital
    letters (right-aligned: the same letters for the same trailing broadcast axes)."""
    text = equation.replace(" ", "")
    lhs, _, out = text.partition("->")
    parts = lhs.split(",")
    if len(parts) != len(operands):
        raise CompileError(f"einsum {equation!r} names {len(parts)} operands, got {len(operands)}")
    widest = max(
        (
            v.type.rank - len(p.replace("...", ""))
            for p, v in zip(parts, operands, strict=True)
            if "..." in p
        ),
        default=0,
    )
    fill = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:widest]
    spelled = []
    for p, v in zip(parts, operands, strict=True):
        n = v.type.rank - len(p.replace("...", ""))
        spelled.append(p.replace("...", fill[widest - n :]) if "..." in p else p)
    if "->" not in text:  # implicit output: the letters seen once, sorted
        seen = "".join(spelled)
        out = fill + "".join(sorted(c for c in set(seen) if seen.count(c) == 1 and c.islower()))
    return spelled, out.replace("...", fill)


def einsum(cx: EmitContext, equation: str, operands: list[Value]) -> Value:
    """One or two operands as transposes, sums and one (batched) matmul: each operand's
    axes that appear nowhere else are summed first; two operands are permuted to [batch,
    free, contracted] and [batch, contracted, free], flattened, multiplied, unflattened.
    Repeated subscripts (diagonals) and broadcasting '...' axes of size 1 are not
    supported."""
    subs, out = _spelled(equation, operands)
    if len(operands) not in (1, 2) or any(len(set(s)) != len(s) for s in subs):
        raise CompileError(f"einsum {equation!r}: one or two operands, no repeated subscripts")
    dims: dict[str, int] = {}
    for s, v in zip(subs, operands, strict=True):
        for c, d in zip(s, v.shape, strict=True):
            if dims.setdefault(c, d) != d:
                raise CompileError(f"einsum {equation!r}: axis {c!r} is {dims[c]} and {d}")
    values = []
    for k, (s, v) in enumerate(zip(subs, operands, strict=True)):
        others = out + "".join(subs[:k] + subs[k + 1 :])
        alone = tuple(i for i, c in enumerate(s) if c not in others)
        if alone:
            v = cx.call("sum", v, axes=alone, keepdims=False)
            s = "".join(c for c in s if c in others)
        values.append((s, v))
    if len(values) == 1:
        return _arrange(cx, values[0][1], values[0][0], out)
    (a_s, a), (b_s, b) = values
    batch = "".join(c for c in a_s if c in b_s and c in out)
    contract = "".join(c for c in a_s if c in b_s and c not in out)
    a_free = "".join(c for c in a_s if c not in b_s)
    b_free = "".join(c for c in b_s if c not in a_s)

    def size(letters: str) -> int:
        return int(np.prod([dims[c] for c in letters], dtype=np.int64))

    lead = (size(batch),) if batch else ()
    x = _reshape(
        cx, _arrange(cx, a, a_s, batch + a_free + contract), (*lead, size(a_free), size(contract))
    )
    y = _reshape(
        cx, _arrange(cx, b, b_s, batch + contract + b_free), (*lead, size(contract), size(b_free))
    )
    got = batch + a_free + b_free
    z = _reshape(cx, cx.call("matmul", x, y), tuple(dims[c] for c in got))
    return _arrange(cx, z, got, out)


def group_normalise(
    cx: EmitContext, x: Value, groups: int, eps: float
) -> tuple[Value, Value, Value]:
    """``x`` [N, C, ...] normalised over each of ``groups`` groups of channels and their
    positions, no affine: the IR's fused ``layer_norm`` over [N, groups, rest]. Returns
    (y, mean, rstd), the statistics [N, groups] (group norm; instance norm is C groups)."""
    n = x.shape[0]
    size = x.type.numel // (n * groups)
    grouped = cx.call("reshape", x, shape=(n, groups, size))
    ones, zeros = cx.full(1.0, x.dtype, (size,)), cx.full(0.0, x.dtype, (size,))
    y, mean, rstd = cx.call_multi("layer_norm", grouped, ones, zeros, eps=float(eps), ndim=1)
    stats = (n, groups)
    return (cx.call("reshape", y, shape=x.shape), cx.call("reshape", mean, shape=stats),
            cx.call("reshape", rstd, shape=stats))  # fmt: skip


def arg_extreme(
    cx: EmitContext, x: Value, axis: int, keepdims: bool, lowest: bool, last: bool = False
) -> Value:
    """The position of the maximum (``lowest``: minimum) along ``axis``, int64: the first
    of equal extremes (as ATen's argmax), or the last (ONNX's ``select_last_index``)."""
    v = cx.call("neg", x) if lowest else x
    hit = cx.call("eq", v, cx.call("amax", v, axes=(axis,), keepdims=True))
    n = x.shape[axis]
    shape = tuple(n if i == axis else 1 for i in range(x.type.rank))
    pos = cx.call("reshape", cx.call("arange", start=0, stop=n, step=1, dtype="i64"), shape=shape)
    if last:
        return cx.call(
            "amax",
            cx.call("where", hit, pos, cx.full(-1, DType.I64)),
            axes=(axis,),
            keepdims=keepdims,
        )
    far = cx.call("where", hit, cx.call("neg", pos), cx.full(-n, DType.I64))
    return cx.call("neg", cx.call("amax", far, axes=(axis,), keepdims=keepdims))


def amin(cx: EmitContext, x: Value, axes: tuple[int, ...] | None, keepdims: bool) -> Value:
    """The minimum over ``axes`` (None: all) as -amax(-x): the IR has one extremum op."""
    return cx.call("neg", cx.call("amax", cx.call("neg", x), axes=axes, keepdims=keepdims))


def l2_norm(cx: EmitContext, x: Value, axes: tuple[int, ...] | None, keepdims: bool) -> Value:
    """sqrt(sum(x^2)) over ``axes``; the root reads max(sum, 1e-30), so a zero vector gets
    gradient 0 (ATen's choice), not 0/0."""
    squares = cx.call("sum", cx.call("mul", x, x), axes=axes, keepdims=keepdims)
    return cx.call("sqrt", cx.call("maximum", squares, cx.full(1e-30, x.dtype)))
