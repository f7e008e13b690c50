"""Convolution: conv2d and its two backward kernels (NCHW activations, OIHW weights).

Pooling lives in ``pool.py`` and normalisation in ``norm.py``; the window
geometry they share is in ``_window.py``.

The reference kernels are fast enough to train small CNNs: a grouped
convolution is one batched matmul over im2col columns (a strided view of the
padded input, copied once), its input gradient is the transposed matmul
followed by a scatter-add per kernel tap, and a depthwise convolution (one
input channel per group) is an elementwise multiply-accumulate per tap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._window import Pair, Window, check_pair, conv_out_size, float_dtype

__all__: list[str] = []

_GEOMETRY = ("stride", "padding", "dilation", "groups")


def _conv_window(
    op: str,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    stride: object,
    padding: object,
    dilation: object,
    groups: object,
) -> Window:
    """Check a convolution's shapes and attributes; its windows over the input."""
    if len(x_shape) != 4:
        raise ShapeError(f"{op}: the input must be NCHW (rank 4), got shape {list(x_shape)}")
    if len(w_shape) != 4 or min(w_shape) < 1:
        raise ShapeError(f"{op}: the weight must be OIHW (rank 4), got shape {list(w_shape)}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ShapeError(f"{op}: groups must be a positive int, got {groups!r}")
    (_, c, h, w), (o, cg, kh, kw) = x_shape, w_shape
    if cg * groups != c or o % groups:
        raise ShapeError(
            f"{op}: weight {list(w_shape)} with groups={groups} does not fit an input "
            f"of {c} channels (needs in_channels = groups * weight.shape[1] and "
            f"out_channels divisible by groups)"
        )
    s = check_pair(op, "stride", stride, 1)
    p = check_pair(op, "padding", padding, 0)
    d = check_pair(op, "dilation", dilation, 1)
    out = (conv_out_size(h, kh, s[0], p[0], d[0]), conv_out_size(w, kw, s[1], p[1], d[1]))
    if min(out) < 1:
        raise ShapeError(
            f"{op}: kernel {kh}x{kw} with dilation {d} does not fit the padded input "
            f"{h + 2 * p[0]}x{w + 2 * p[1]}"
        )
    return Window((h, w), out, (kh, kw), s, p, d)


def _shape_of(op: str, name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(d, int) for d in value):
        raise ShapeError(f"{op}: {name} must be a tuple of ints, got {value!r}")
    return value


def _columns(xp: Array, win: Window) -> Array:
    """A read-only view (N, C, kh, kw, H_out, W_out) of every tap of every window."""
    n, c = xp.shape[:2]
    sn, sc, sh, sw = xp.strides
    shape = (n, c, *win.kernel, *win.out_hw)
    strides = (
        sn,
        sc,
        sh * win.dilation[0],
        sw * win.dilation[1],
        sh * win.stride[0],
        sw * win.stride[1],
    )
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def _is_pointwise(win: Window) -> bool:
    return win.kernel == (1, 1) and win.stride == (1, 1) and win.padding == (0, 0)


def _conv_forward(x: Array, w: Array, win: Window, groups: int) -> Array:
    n, (o, cg, kh, kw) = x.shape[0], w.shape
    xp = win.pad(x, 0.0)
    if cg == 1:
        return _depthwise_forward(xp, w, win)
    cols = _columns(xp, win).reshape(n, groups, cg * kh * kw, -1)
    y: Array = np.matmul(w.reshape(groups, o // groups, cg * kh * kw), cols)
    return y.reshape(n, o, *win.out_hw)


def _depthwise_forward(xp: Array, w: Array, win: Window) -> Array:
    (n, c), m = xp.shape[:2], w.shape[0] // xp.shape[1]
    wt = w.reshape(c, m, *win.kernel, 1, 1)
    y = np.zeros((n, c, m, *win.out_hw), xp.dtype)
    tmp = np.empty((n, c, *win.out_hw), xp.dtype)
    for _, i, j in win.taps():
        xs = xp[(..., *win.tap(i, j))]
        for q in range(m):
            np.multiply(xs, wt[:, q, i, j], out=tmp)
            y[:, :, q] += tmp
    return y.reshape(n, c * m, *win.out_hw)


def _conv_input_grad(gy: Array, w: Array, win: Window, groups: int) -> Array:
    n, (o, cg, kh, kw) = gy.shape[0], w.shape
    c = cg * groups
    gxp = win.zeros_padded((n, c), gy.dtype)
    if cg == 1:
        _depthwise_input_grad(gxp, gy, w, win)
        return win.crop(gxp)
    wm = w.reshape(groups, o // groups, cg * kh * kw).transpose(0, 2, 1)
    gcols: Array = np.matmul(wm, gy.reshape(n, groups, o // groups, -1))
    if _is_pointwise(win):
        return gcols.reshape(n, c, *win.in_hw)
    gcols = gcols.reshape(n, c, kh, kw, *win.out_hw)
    for _, i, j in win.taps():
        gxp[(..., *win.tap(i, j))] += gcols[:, :, i, j]
    return win.crop(gxp)


def _depthwise_input_grad(gxp: Array, gy: Array, w: Array, win: Window) -> None:
    """Scatter-add into ``gxp`` (padded, one channel per group) the input gradient."""
    (n, c), m = gxp.shape[:2], w.shape[0] // gxp.shape[1]
    wt = w.reshape(c, m, *win.kernel, 1, 1)
    gy5 = gy.reshape(n, c, m, *win.out_hw)
    tmp = np.empty((n, c, *win.out_hw), gy.dtype)
    for _, i, j in win.taps():
        gxs = gxp[(..., *win.tap(i, j))]
        for q in range(m):
            np.multiply(gy5[:, :, q], wt[:, q, i, j], out=tmp)
            gxs += tmp


def _conv_weight_grad(
    x: Array, gy: Array, w_shape: tuple[int, ...], win: Window, groups: int
) -> Array:
    n, (o, cg, kh, kw) = x.shape[0], w_shape
    xp = win.pad(x, 0.0)
    if cg == 1:
        return _depthwise_weight_grad(xp, gy, w_shape, win)
    cols = _columns(xp, win).reshape(n, groups, cg * kh * kw, -1)
    gym = gy.reshape(n, groups, o // groups, -1)
    gw: Array = np.matmul(gym, cols.transpose(0, 1, 3, 2)).sum(axis=0)
    return gw.reshape(w_shape)


def _depthwise_weight_grad(xp: Array, gy: Array, w_shape: tuple[int, ...], win: Window) -> Array:
    (n, c), m = xp.shape[:2], w_shape[0] // xp.shape[1]
    gy5 = gy.reshape(n, c, m, *win.out_hw)
    gw = np.empty((c, m, *win.kernel), gy.dtype)
    for _, i, j in win.taps():
        xs = xp[(..., *win.tap(i, j))]
        for q in range(m):
            gw[:, q, i, j] = np.einsum("nchw,nchw->c", gy5[:, :, q], xs)
    return gw.reshape(w_shape)


def _conv_flops(gy: TensorType, w_shape: tuple[int, ...]) -> int:
    """2 * N * C_out * H_out * W_out * (C_in / groups) * kh * kw."""
    return 2 * gy.numel * int(np.prod(w_shape[1:], dtype=np.int64))


@defop("conv2d")
class Conv2d:
    """2-D cross-correlation, as torch.nn.functional.conv2d: x NCHW, w OIHW with
    I = C_in / groups, optional bias b of shape (O,). Attributes: stride, padding
    (symmetric, per side), dilation (pairs of ints) and groups (int).

    Forward: y[n, o, oh, ow] = b[o] + sum_{c in group(o), i, j}
    w[o, c, i, j] * x_pad[n, c, oh*sh + i*dh, ow*sw + j*dw].
    Backward: gx = conv2d_input_grad(gy, w), gw = conv2d_weight_grad(x, gy),
    gb = sum(gy, axes=(0, 2, 3)).
    """

    @staticmethod
    def infer(
        x: TensorType,
        w: TensorType,
        b: TensorType | None = None,
        *,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> TensorType:
        dtype = float_dtype("conv2d", x, w, *(() if b is None else (b,)))
        win = _conv_window("conv2d", x.shape, w.shape, stride, padding, dilation, groups)
        if b is not None and b.shape != (w.shape[0],):
            raise ShapeError(f"conv2d: bias {b} must have shape [{w.shape[0]}]")
        return TensorType((x.shape[0], w.shape[0], *win.out_hw), dtype)

    @staticmethod
    def kernel(
        x: Array,
        w: Array,
        b: Array | None = None,
        *,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> Array:
        win = _conv_window("conv2d", x.shape, w.shape, stride, padding, dilation, groups)
        y = _conv_forward(x, w, win, groups)
        if b is not None:
            y += b.reshape(-1, 1, 1)
        return y

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        bias = outs[0].numel if len(ins) == 3 else 0
        return _conv_flops(outs[0], ins[1].shape) + bias

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w = c.inputs[:2]
        geometry = {k: c.attrs[k] for k in _GEOMETRY}
        grads = [
            c.call("conv2d_input_grad", c.ct, w, x_shape=x.shape, **geometry)
            if c.needs[0]
            else None,
            c.call("conv2d_weight_grad", x, c.ct, w_shape=w.shape, **geometry)
            if c.needs[1]
            else None,
        ]
        if len(c.inputs) == 3:
            needs_b = c.needs[2]
            grads.append(c.call("sum", c.ct, axes=(0, 2, 3), keepdims=False) if needs_b else None)
        return grads

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [_conv_sample(rng, *case) for case in _CONV_CASES]


# (x shape, w shape, bias, stride, padding, dilation, groups)
_ConvCase = tuple[tuple[int, ...], tuple[int, ...], bool, Pair, Pair, Pair, int]
_CONV_CASES: tuple[_ConvCase, ...] = (
    ((2, 3, 6, 7), (4, 3, 3, 3), True, (1, 1), (1, 1), (1, 1), 1),  # same padding
    ((2, 3, 8, 9), (4, 3, 3, 3), False, (2, 2), (1, 0), (1, 1), 1),  # stride 2, uncovered rows
    ((2, 4, 7, 6), (4, 1, 3, 3), True, (2, 2), (1, 1), (1, 1), 4),  # depthwise, stride 2
    ((1, 3, 5, 5), (6, 1, 3, 2), False, (1, 2), (1, 0), (1, 1), 3),  # depthwise, multiplier 2
    ((1, 2, 9, 8), (3, 2, 3, 2), True, (1, 1), (2, 1), (2, 3), 1),  # dilated
    ((2, 4, 5, 5), (6, 2, 2, 2), True, (2, 1), (0, 1), (1, 1), 2),  # two groups
    ((2, 5, 4, 3), (3, 5, 1, 1), False, (1, 1), (0, 0), (1, 1), 1),  # pointwise
)


def _conv_sample(
    rng: np.random.Generator,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    bias: bool,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
    groups: int,
) -> Sample:
    arrays = [rng.standard_normal(x_shape), rng.standard_normal(w_shape)]
    if bias:
        arrays.append(rng.standard_normal(w_shape[0]))
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return Sample(tuple(arrays), attrs)


def _grad_samples(rng: np.random.Generator, which: str) -> list[Sample]:
    samples = []
    for case in _CONV_CASES:
        forward = _conv_sample(rng, *case)
        x, w = forward.inputs[:2]
        gy = rng.standard_normal(tuple(Conv2d.kernel(x, w, **forward.attrs).shape))
        if which == "input":
            samples.append(Sample((gy, w), {"x_shape": x.shape, **forward.attrs}))
        else:
            samples.append(Sample((x, gy), {"w_shape": w.shape, **forward.attrs}))
    return samples


@defop("conv2d_input_grad")
class Conv2dInputGrad:
    """The gradient of conv2d with respect to its input (a transposed convolution).

    Forward: gx[n, c, h, w] = sum over (o, i, j) with h = oh*sh - ph + i*dh and
    w = ow*sw - pw + j*dw of gy[n, o, oh, ow] * w[o, c, i, j]; input positions
    that no window reads get zero. It is also the forward of a transposed convolution
    (ConvTranspose2d: gy its input, w its weight, x_shape its output's shape).
    Backward (the adjoints of a linear map): ggy = conv2d(gx_ct, w),
    gw = conv2d_weight_grad(gx_ct, gy), with the same geometry.
    """

    @staticmethod
    def infer(
        gy: TensorType,
        w: TensorType,
        *,
        x_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> TensorType:
        op = "conv2d_input_grad"
        dtype = float_dtype(op, gy, w)
        x_shape = _shape_of(op, "x_shape", x_shape)
        win = _conv_window(op, x_shape, w.shape, stride, padding, dilation, groups)
        expected = (x_shape[0], w.shape[0], *win.out_hw)
        if gy.shape != expected:
            raise ShapeError(f"{op}: gy {gy} must have shape {list(expected)}")
        return TensorType(x_shape, dtype)

    @staticmethod
    def kernel(
        gy: Array,
        w: Array,
        *,
        x_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> Array:
        win = _conv_window("conv2d_input_grad", x_shape, w.shape, stride, padding, dilation, groups)
        return _conv_input_grad(gy, w, win, groups)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return _conv_flops(ins[0], ins[1].shape)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        gy, w = c.inputs
        geometry = {k: c.attrs[k] for k in _GEOMETRY}
        return [
            c.call("conv2d", c.ct, w, **geometry) if c.needs[0] else None,
            c.call("conv2d_weight_grad", c.ct, gy, w_shape=w.shape, **geometry)
            if c.needs[1]
            else None,
        ]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _grad_samples(rng, "input")


@defop("conv2d_weight_grad")
class Conv2dWeightGrad:
    """The gradient of conv2d with respect to its weight.

    Forward: gw[o, c, i, j] = sum_{n, oh, ow} gy[n, o, oh, ow] *
    x_pad[n, c', oh*sh + i*dh, ow*sw + j*dw], c' the c-th channel of o's group.
    Backward: none (a backward kernel).
    """

    @staticmethod
    def infer(
        x: TensorType,
        gy: TensorType,
        *,
        w_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> TensorType:
        op = "conv2d_weight_grad"
        dtype = float_dtype(op, x, gy)
        w_shape = _shape_of(op, "w_shape", w_shape)
        win = _conv_window(op, x.shape, w_shape, stride, padding, dilation, groups)
        expected = (x.shape[0], w_shape[0], *win.out_hw)
        if gy.shape != expected:
            raise ShapeError(f"{op}: gy {gy} must have shape {list(expected)}")
        return TensorType(w_shape, dtype)

    @staticmethod
    def kernel(
        x: Array,
        gy: Array,
        *,
        w_shape: tuple[int, ...],
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        groups: int,
    ) -> Array:
        win = _conv_window(
            "conv2d_weight_grad", x.shape, w_shape, stride, padding, dilation, groups
        )
        return _conv_weight_grad(x, gy, w_shape, win, groups)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return _conv_flops(ins[1], outs[0].shape)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return _grad_samples(rng, "weight")
