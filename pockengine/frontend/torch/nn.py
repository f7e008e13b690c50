"""ATen converters: convolution, pooling, normalisation, dropout."""

from __future__ import annotations

from typing import Any

from pockengine.frontend.compose import transposed_conv2d
from pockengine.frontend.lowering import batch_norm_eval
from pockengine.frontend.torch.converters import Ctx, aten
from pockengine.ir import CompileError, DType, Value

__all__: list[str] = []


def _pair(v: Any) -> tuple[int, int]:
    seq = [v] if isinstance(v, int) else list(v)
    return (int(seq[0]), int(seq[-1])) if seq else (1, 1)


def _height_one(cx: Ctx, v: Value) -> Value:
    """A 1-d convolution's [N, C, L] input or [O, I, K] weight as 2-d, of height one."""
    return cx.call("reshape", v, shape=(v.shape[0], v.shape[1], 1, v.shape[2]))


@aten("convolution.default")
def _convolution(
    cx: Ctx,
    x: Value,
    w: Value,
    bias: Value | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Value:
    if transposed:
        return _transposed(cx, x, w, bias, stride, padding, dilation, groups)
    if x.type.rank == 3:  # conv1d runs as conv2d over a height of one
        x, w = _height_one(cx, x), _height_one(cx, w)
        y = _conv2d(cx, x, w, bias, (1, stride[0]), (0, padding[0]), (1, dilation[0]), groups)
        return cx.call("reshape", y, shape=cx.out_type.shape)
    if x.type.rank != 4:
        raise CompileError(f"{x.type.rank - 2}-d convolution is not supported")
    return _conv2d(cx, x, w, bias, _pair(stride), _pair(padding), _pair(dilation), groups)


def _transposed(
    cx: Ctx,
    x: Value,
    w: Value,
    bias: Value | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> Value:
    """ConvTranspose1d/2d: the input gradient of the convolution it transposes (w is
    [C_in, C_out / groups, kh, kw], that convolution's weight), at the output's shape,
    so output_padding is in the shape; then the bias."""
    out = cx.out_type.shape
    if x.type.rank == 3:  # 1-d: a height of one
        x, w = _height_one(cx, x), _height_one(cx, w)
        geometry = ((1, stride[0]), (0, padding[0]), (1, dilation[0]))
        shape: tuple[int, ...] = (out[0], out[1], 1, out[2])
    elif x.type.rank == 4:
        geometry = (_pair(stride), _pair(padding), _pair(dilation))
        shape = tuple(out)
    else:
        raise CompileError(f"{x.type.rank - 2}-d transposed convolution is not supported")
    s, p, d = geometry
    y = transposed_conv2d(cx, x, w, shape, s, (p, p), d, int(groups))
    if bias is not None:
        y = cx.call("add", y, cx.call("reshape", bias, shape=(1, shape[1], 1, 1)))
    return cx.call("reshape", y, shape=tuple(out)) if len(out) == 3 else y


def _conv2d(
    cx: Ctx,
    x: Value,
    w: Value,
    bias: Value | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
) -> Value:
    inputs = (x, w) if bias is None else (x, w, bias)
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": int(groups)}
    return cx.call("conv2d", *inputs, **attrs)


@aten("max_pool2d_with_indices.default")
def _max_pool(
    cx: Ctx,
    x: Value,
    kernel_size: list[int],
    stride: Any = (),
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> tuple[Value, None]:
    kernel = _pair(kernel_size)
    y = cx.call(
        "max_pool2d",
        x,
        kernel=kernel,
        stride=_pair(stride) if stride else kernel,
        padding=_pair(padding),
        dilation=_pair(dilation),
        ceil_mode=bool(ceil_mode),
    )
    return y, None  # the indices only serve ATen's own backward


@aten("avg_pool2d.default")
def _avg_pool(
    cx: Ctx,
    x: Value,
    kernel_size: list[int],
    stride: Any = (),
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Value:
    kernel = _pair(kernel_size)
    return cx.call(
        "avg_pool2d",
        x,
        kernel=kernel,
        stride=_pair(stride) if stride else kernel,
        padding=_pair(padding),
        ceil_mode=bool(ceil_mode),
        count_include_pad=bool(count_include_pad),
        divisor_override=divisor_override,
    )


@aten("_adaptive_avg_pool2d.default")
def _adaptive_avg_pool(cx: Ctx, x: Value, output_size: list[int]) -> Value:
    oh, ow = _pair(output_size)
    h, w = x.shape[2], x.shape[3]
    if (oh, ow) == (1, 1):
        return cx.call("mean", x, axes=(2, 3), keepdims=True)
    if h % oh or w % ow:
        raise CompileError(f"adaptive pooling of {h}x{w} to {oh}x{ow} needs divisible sizes")
    return _avg_pool(cx, x, [h // oh, w // ow])


# -- normalisation ----------------------------------------------------------------


def _affine(cx: Ctx, v: Value | None, x: Value, fill: float, size: int) -> Value:
    return v if v is not None else cx.full(fill, x.dtype, (size,))


def _bn_eval(cx: Ctx, x: Value, w: Value, b: Value, mean: Value, var: Value, eps: float) -> Value:
    return batch_norm_eval(cx.b, cx.source, x, w, b, mean, var, eps)


@aten("_native_batch_norm_legit_functional.default")
def _bn_functional(
    cx: Ctx,
    x: Value,
    w: Value | None,
    b: Value | None,
    running_mean: Value,
    running_var: Value,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Value, ...]:
    c = x.shape[1]
    w, b = _affine(cx, w, x, 1.0, c), _affine(cx, b, x, 0.0, c)
    if not training:
        y = _bn_eval(cx, x, w, b, running_mean, running_var, eps)
        return y, running_mean, running_var, running_mean, running_var
    y, mean, var = cx.call_multi("batch_norm", x, w, b, eps=float(eps))
    n = x.type.numel // c
    keep = cx.full(1.0 - momentum, x.dtype)
    new_mean = cx.call(
        "add", cx.call("mul", running_mean, keep), cx.call("mul", mean, cx.full(momentum, x.dtype))
    )
    unbiased = cx.full(momentum * n / max(n - 1, 1), x.dtype)
    new_var = cx.call("add", cx.call("mul", running_var, keep), cx.call("mul", var, unbiased))
    rstd = cx.call("rsqrt", cx.call("add", var, cx.full(eps, x.dtype)))
    return y, mean, rstd, new_mean, new_var


@aten("_native_batch_norm_legit_no_training.default")
def _bn_no_training(
    cx: Ctx,
    x: Value,
    w: Value | None,
    b: Value | None,
    running_mean: Value,
    running_var: Value,
    momentum: float,
    eps: float,
) -> tuple[Value, None, None]:
    c = x.shape[1]
    w, b = _affine(cx, w, x, 1.0, c), _affine(cx, b, x, 0.0, c)
    return _bn_eval(cx, x, w, b, running_mean, running_var, eps), None, None


@aten("_native_batch_norm_legit.no_stats")
def _bn_no_stats(
    cx: Ctx, x: Value, w: Value | None, b: Value | None, training: bool, momentum: float, eps: float
) -> tuple[Value, ...]:
    c = x.shape[1]
    w, b = _affine(cx, w, x, 1.0, c), _affine(cx, b, x, 0.0, c)
    y, mean, var = cx.call_multi("batch_norm", x, w, b, eps=float(eps))
    return y, mean, cx.call("rsqrt", cx.call("add", var, cx.full(eps, x.dtype)))


@aten("native_layer_norm.default")
def _layer_norm(
    cx: Ctx, x: Value, shape: list[int], w: Value | None, b: Value | None, eps: float
) -> tuple[Value, ...]:
    nd = len(shape)
    size = tuple(x.shape[-nd:])
    w = w if w is not None else cx.full(1.0, x.dtype, size)
    b = b if b is not None else cx.full(0.0, x.dtype, size)
    return cx.call_multi("layer_norm", x, w, b, eps=float(eps), ndim=nd)


@aten("native_dropout.default")
def _dropout(cx: Ctx, x: Value, p: float, train: bool | None) -> tuple[Value, Value | None]:
    if not train or p == 0:
        return x, None
    if p >= 1:
        return cx.full(0.0, x.dtype, x.shape), None
    return cx.dropout(x, p)


@aten("bernoulli.p")
def _bernoulli(cx: Ctx, like: Value, p: float = 0.5, generator: Any = None) -> Value:
    """Ones with probability ``p``, else zeros, in ``like``'s shape: stochastic depth's
    per-sample mask (timm's ``drop_path``, torchvision's ``StochasticDepth``). The step's
    dropout randomness draws it (``random_mask`` at rate 1 - p: a new mask each step)."""
    p = float(p)
    dtype = cx.out_type.dtype
    if p >= 1.0:
        return cx.full(1.0, dtype, like.shape)
    if p <= 0.0:
        return cx.full(0.0, dtype, like.shape)
    keep = cx.call("ne", cx.random_mask(like.shape, 1.0 - p), cx.full(0.0, DType.F32))
    return cx.cast(keep, dtype)
