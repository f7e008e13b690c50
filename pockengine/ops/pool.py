"""2-D pooling over the last two axes of (N)CHW inputs, with ATen's semantics.

Output sizes follow ATen's pooling_output_shape, ceil_mode included; padding
is at most half the kernel. Max pooling treats padding as -inf and sends the
gradient to the first maximum of each window in row-major order, as ATen.
Average pooling divides by the window's size clipped to the padded input
(count_include_pad), by the number of input elements in it, or by
divisor_override.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pockengine.ir import Attrs, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._window import Pair, Window, check_pair, float_dtype, pool_out_size

__all__: list[str] = []


def _pool_window(
    op: str,
    x_shape: tuple[int, ...],
    kernel: object,
    stride: object,
    padding: object,
    dilation: object,
    ceil_mode: object,
) -> Window:
    """Check a pooling's input rank and attributes; its windows over the input."""
    if len(x_shape) not in (3, 4):
        raise ShapeError(f"{op}: the input must be CHW or NCHW, got shape {list(x_shape)}")
    k = check_pair(op, "kernel", kernel, 1)
    s = check_pair(op, "stride", stride, 1)
    p = check_pair(op, "padding", padding, 0)
    d = check_pair(op, "dilation", dilation, 1)
    if not isinstance(ceil_mode, bool):
        raise ShapeError(f"{op}: ceil_mode must be a bool, got {ceil_mode!r}")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ShapeError(f"{op}: padding {p} must be at most half the kernel {k}")
    h, w = x_shape[-2:]
    out = (
        pool_out_size(h, k[0], s[0], p[0], d[0], ceil_mode),
        pool_out_size(w, k[1], s[1], p[1], d[1], ceil_mode),
    )
    if min(out) < 1:
        raise ShapeError(f"{op}: kernel {k} with dilation {d} does not fit the input {h}x{w}")
    return Window((h, w), out, k, s, p, d)


def _window_flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Attrs) -> int:
    """One operation per kernel tap of every window (the windows are the smaller side)."""
    kernel = check_pair("pool", "kernel", attrs["kernel"], 1)
    windows = min(t.numel for t in (*ins, *outs))
    return windows * kernel[0] * kernel[1]


def _max_windows(x: Array, win: Window) -> Array:
    """The maximum of each window (NaN if the window holds one, as ATen)."""
    xp = win.pad(x, -np.inf)
    best = xp[(..., *win.tap(0, 0))].copy()
    for t, i, j in win.taps():
        if t > 0:
            np.maximum(best, xp[(..., *win.tap(i, j))], out=best)
    return best


def _first_argmax(x: Array, win: Window) -> Array:
    """The tap index (i*kw + j) of the first maximum of each window, in row-major order.

    As ATen's kernel, except in windows holding NaN (the first NaN here, the last in
    ATen) or only -inf (which may pick a padding position; ATen picks the first input).
    """
    xp = win.pad(x, -np.inf)
    windows = np.stack([xp[(..., *win.tap(i, j))] for _, i, j in win.taps()], axis=-1)
    index: Array = np.argmax(windows, axis=-1)
    return index


_MAX_ATTRS = ("kernel", "stride", "padding", "dilation", "ceil_mode")


@defop("max_pool2d")
class MaxPool2d:
    """Max pooling, as torch.nn.functional.max_pool2d (the indices are not a result).
    Attributes: kernel, stride, padding, dilation (pairs of ints), ceil_mode (bool).

    Forward: y[..., oh, ow] = max_{i, j} x_pad[..., oh*sh + i*dh, ow*sw + j*dw], padding
    being -inf. Backward: gx = max_pool2d_grad(gy, x): each gy goes to the first maximum
    of its window.
    """

    flops = staticmethod(_window_flops)

    @staticmethod
    def infer(
        x: TensorType,
        *,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        ceil_mode: bool,
    ) -> TensorType:
        dtype = float_dtype("max_pool2d", x)
        win = _pool_window("max_pool2d", x.shape, kernel, stride, padding, dilation, ceil_mode)
        return TensorType((*x.shape[:-2], *win.out_hw), dtype)

    @staticmethod
    def kernel(
        x: Array, *, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair, ceil_mode: bool
    ) -> Array:
        win = _pool_window("max_pool2d", x.shape, kernel, stride, padding, dilation, ceil_mode)
        return _max_windows(x, win)

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("max_pool2d_grad", c.ct, c.inputs[0], **c.attrs),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        # Normal draws have no ties, so the maximum of every window is unique.
        return [
            Sample((rng.standard_normal(shape),), dict(zip(_MAX_ATTRS, attrs, strict=True)))
            for shape, attrs in _MAX_CASES
        ]


_MAX_CASES: tuple[tuple[tuple[int, ...], tuple[object, ...]], ...] = (
    ((2, 3, 7, 7), ((3, 3), (2, 2), (1, 1), (1, 1), False)),
    ((1, 2, 8, 9), ((3, 2), (2, 3), (1, 0), (1, 1), True)),  # the last window overhangs
    ((2, 2, 9, 9), ((2, 3), (1, 2), (1, 1), (2, 2), False)),  # dilated
    ((3, 6, 6), ((2, 2), (2, 2), (0, 0), (1, 1), False)),  # CHW
)


@defop("max_pool2d_grad")
class MaxPool2dGrad:
    """The gradient of max_pool2d: inputs gy and the pooled x, max_pool2d's attributes.

    Forward: gx[..., h, w] = sum of gy over the windows whose first maximum (in row-major
    tap order) is x[..., h, w]. Backward: none (a backward kernel).
    """

    flops = staticmethod(_window_flops)

    @staticmethod
    def infer(
        gy: TensorType,
        x: TensorType,
        *,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        ceil_mode: bool,
    ) -> TensorType:
        op = "max_pool2d_grad"
        dtype = float_dtype(op, gy, x)
        win = _pool_window(op, x.shape, kernel, stride, padding, dilation, ceil_mode)
        if gy.shape != (*x.shape[:-2], *win.out_hw):
            raise ShapeError(f"{op}: gy {gy} does not match the pooling of {x}")
        return TensorType(x.shape, dtype)

    @staticmethod
    def kernel(
        gy: Array,
        x: Array,
        *,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        ceil_mode: bool,
    ) -> Array:
        win = _pool_window("max_pool2d_grad", x.shape, kernel, stride, padding, dilation, ceil_mode)
        index = _first_argmax(x, win)
        gxp = win.zeros_padded(x.shape[:-2], gy.dtype)
        for t, i, j in win.taps():
            gxp[(..., *win.tap(i, j))] += np.where(index == t, gy, 0)
        return win.crop(gxp)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in MaxPool2d.samples(rng):
            (x,) = sample.inputs
            gy = rng.standard_normal(tuple(MaxPool2d.kernel(x, **sample.attrs).shape))
            out.append(Sample((gy, x), sample.attrs))
        return out


_AVG_ATTRS = ("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _avg_window(
    op: str,
    x_shape: tuple[int, ...],
    kernel: object,
    stride: object,
    padding: object,
    ceil_mode: object,
    count_include_pad: object,
    divisor_override: object,
) -> Window:
    win = _pool_window(op, x_shape, kernel, stride, padding, (1, 1), ceil_mode)
    if not isinstance(count_include_pad, bool):
        raise ShapeError(f"{op}: count_include_pad must be a bool, got {count_include_pad!r}")
    if divisor_override is not None and (
        not isinstance(divisor_override, int)
        or isinstance(divisor_override, bool)
        or divisor_override == 0
    ):
        raise ShapeError(f"{op}: divisor_override must be None or a non-zero int")
    return win


def _avg_divisor(win: Window, count_include_pad: bool, divisor_override: int | None) -> Array:
    """The divisor of every output position, shape (H_out, W_out), as in ATen's kernel."""
    if divisor_override is not None:
        return np.full(win.out_hw, float(divisor_override))
    counts = []
    for axis in (0, 1):
        size, pad = win.in_hw[axis], win.padding[axis]
        start = np.arange(win.out_hw[axis]) * win.stride[axis] - pad
        end = np.minimum(start + win.kernel[axis], size + pad)
        if count_include_pad:
            counts.append(end - start)
        else:
            counts.append(np.minimum(end, size) - np.maximum(start, 0))
    return np.outer(*counts).astype(np.float64)


@defop("avg_pool2d")
class AvgPool2d:
    """Average pooling, as torch.nn.functional.avg_pool2d. Attributes: kernel, stride,
    padding (pairs of ints), ceil_mode, count_include_pad (bools), divisor_override
    (None or a non-zero int).

    Forward: y[..., oh, ow] = sum_{i, j} x_pad[..., oh*sh + i, ow*sw + j] / divisor[oh, ow],
    zero padding; the divisor is divisor_override, else the window's size clipped to the
    padded input (count_include_pad) or the number of input elements in it.
    Backward: gx = avg_pool2d_grad(gy): every input position of a window gets gy / divisor.
    """

    flops = staticmethod(_window_flops)

    @staticmethod
    def infer(
        x: TensorType,
        *,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> TensorType:
        dtype = float_dtype("avg_pool2d", x)
        win = _avg_window(
            "avg_pool2d",
            x.shape,
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
            divisor_override,
        )
        return TensorType((*x.shape[:-2], *win.out_hw), dtype)

    @staticmethod
    def kernel(
        x: Array,
        *,
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> Array:
        win = _pool_window("avg_pool2d", x.shape, kernel, stride, padding, (1, 1), ceil_mode)
        xp = win.pad(x, 0.0)
        total = xp[(..., *win.tap(0, 0))].copy()
        for t, i, j in win.taps():
            if t > 0:
                total += xp[(..., *win.tap(i, j))]
        total /= _avg_divisor(win, count_include_pad, divisor_override).astype(x.dtype)
        return total

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return (c.call("avg_pool2d_grad", c.ct, x_shape=c.inputs[0].shape, **c.attrs),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample((rng.standard_normal(shape),), dict(zip(_AVG_ATTRS, attrs, strict=True)))
            for shape, attrs in _AVG_CASES
        ]


_AVG_CASES: tuple[tuple[tuple[int, ...], tuple[object, ...]], ...] = (
    ((2, 3, 7, 7), ((3, 3), (2, 2), (1, 1), False, True, None)),
    ((2, 3, 7, 7), ((3, 3), (2, 2), (1, 1), True, False, None)),  # ceil, count_include_pad off
    ((1, 2, 8, 9), ((3, 2), (2, 3), (1, 1), True, True, None)),  # overhang past the padding
    ((2, 2, 6, 6), ((2, 2), (2, 2), (0, 0), False, True, 3)),  # divisor_override
    ((3, 5, 4), ((2, 2), (1, 1), (1, 0), False, False, None)),  # CHW
)


@defop("avg_pool2d_grad")
class AvgPool2dGrad:
    """The gradient of avg_pool2d: input gy, attributes x_shape and avg_pool2d's.

    Forward: gx[..., h, w] = sum over the windows (oh, ow) that read x[..., h, w] of
    gy[..., oh, ow] / divisor[oh, ow]. Backward: none (a backward kernel).
    """

    flops = staticmethod(_window_flops)

    @staticmethod
    def infer(
        gy: TensorType,
        *,
        x_shape: tuple[int, ...],
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> TensorType:
        op = "avg_pool2d_grad"
        dtype = float_dtype(op, gy)
        if not isinstance(x_shape, tuple) or not all(isinstance(d, int) for d in x_shape):
            raise ShapeError(f"{op}: x_shape must be a tuple of ints, got {x_shape!r}")
        win = _avg_window(
            op, x_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
        )
        if gy.shape != (*x_shape[:-2], *win.out_hw):
            raise ShapeError(f"{op}: gy {gy} does not match the pooling of {list(x_shape)}")
        return TensorType(x_shape, dtype)

    @staticmethod
    def kernel(
        gy: Array,
        *,
        x_shape: tuple[int, ...],
        kernel: Pair,
        stride: Pair,
        padding: Pair,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> Array:
        win = _pool_window("avg_pool2d_grad", x_shape, kernel, stride, padding, (1, 1), ceil_mode)
        g = gy / _avg_divisor(win, count_include_pad, divisor_override).astype(gy.dtype)
        gxp = win.zeros_padded(x_shape[:-2], gy.dtype)
        for _, i, j in win.taps():
            gxp[(..., *win.tap(i, j))] += g
        return win.crop(gxp)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in AvgPool2d.samples(rng):
            (x,) = sample.inputs
            gy = rng.standard_normal(tuple(AvgPool2d.kernel(x, **sample.attrs).shape))
            out.append(Sample((gy,), {"x_shape": x.shape, **sample.attrs}))
        return out
