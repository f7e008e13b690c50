"""Normalisation: training-mode batch norm and layer norm, with their backward kernels.

Both return their statistics as results (batch norm: mean and biased variance
per channel, for the running-statistics update; layer norm: mean and 1/std
with kept dims, as ATen's native_layer_norm). Their VJPs differentiate every
result: the cotangents of the statistics, rare in practice, add IR terms
through d mean/dx = 1/n and d var/dx = 2 (x - mean)/n.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pockengine.ir import Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array
from pockengine.ops._window import float_dtype

__all__: list[str] = []


def _check_eps(op: str, eps: object) -> None:
    if not isinstance(eps, float | int) or isinstance(eps, bool) or eps < 0:
        raise ShapeError(f"{op}: eps must be a non-negative number, got {eps!r}")


def _flops(per_element: int) -> Callable[..., int]:
    """A few operations per element of the first input."""

    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return per_element * ins[0].numel

    return flops


def _add_stat_cotangents(
    c: VJPContext,
    gx: Value | None,
    mean: Value,
    gmean: Value | None,
    dev_coef: Value | None,
) -> Value | None:
    """gx + gmean/n + dev_coef * (x - mean), n the elements per statistic.

    ``mean``, ``gmean`` and ``dev_coef`` broadcast against x (kept dims).
    """
    x = c.inputs[0]
    n = x.type.numel // mean.type.numel
    terms = [] if gx is None else [gx]
    if gmean is not None:
        terms.append(c.call("mul", gmean, c.const(1.0 / n, x)))
    if dev_coef is not None:
        dev = c.call("sub", x, mean)
        terms.append(c.call("mul", dev, dev_coef))
    if not terms:
        return None
    total = terms[0]
    for term in terms[1:]:
        total = c.call("add", total, term)
    if total.shape != x.shape:
        total = c.call("broadcast_to", total, shape=x.shape)
    return total


# -- batch norm ---------------------------------------------------------------


def _bn_axes(ndim: int) -> tuple[int, ...]:
    return (0, *range(2, ndim))


def _per_channel(v: Array, ndim: int) -> Array:
    """A [C] vector shaped to broadcast along axis 1 of a rank-``ndim`` tensor."""
    return v.reshape(-1, *([1] * (ndim - 2)))


def _check_channels(op: str, x: TensorType, **vectors: TensorType) -> None:
    if x.rank < 2:
        raise ShapeError(f"{op}: the input must have rank >= 2 (N, C, ...), got {x}")
    for name, v in vectors.items():
        if v.shape != (x.shape[1],):
            raise ShapeError(f"{op}: {name} {v} must have shape [{x.shape[1]}] (channels of {x})")


@defop("batch_norm", facts=Fact.CHEAP)
class BatchNorm:
    """Training-mode batch normalisation over every axis but 1 (N, C, ...); results y,
    mean and the biased variance, both of shape [C].

    Forward: mean = mean(x), var = mean((x - mean)^2) over axes (0, 2, ...);
    y = (x - mean) / sqrt(var + eps) * w + b.
    Backward: (gx, gw, gb) = batch_norm_grad(gy, x, w, mean, var); cotangents of mean and
    var add gmean/n + gvar * 2 (x - mean)/n to gx (n = x.numel / C).
    """

    flops = staticmethod(_flops(7))

    @staticmethod
    def infer(x: TensorType, w: TensorType, b: TensorType, *, eps: float) -> tuple[TensorType, ...]:
        dtype = float_dtype("batch_norm", x, w, b)
        _check_channels("batch_norm", x, weight=w, bias=b)
        _check_eps("batch_norm", eps)
        stat = TensorType((x.shape[1],), dtype)
        return (x, stat, stat)

    @staticmethod
    def kernel(x: Array, w: Array, b: Array, *, eps: float) -> tuple[Array, Array, Array]:
        axes = _bn_axes(x.ndim)
        mean = x.mean(axis=axes)
        y = x - _per_channel(mean, x.ndim)
        var = np.mean(np.square(y), axis=axes)
        y *= _per_channel(w / np.sqrt(var + eps), x.ndim)
        y += _per_channel(b, x.ndim)
        return y, mean, var

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w, _ = c.inputs
        gy, gmean, gvar = c.cts
        _, mean, var = c.node.outputs
        gx = gw = gb = None
        if gy is not None:
            gx, gw, gb = c.call_multi("batch_norm_grad", gy, x, w, mean, var, eps=c.attrs["eps"])
        if c.needs[0] and (gmean is not None or gvar is not None):
            kept = (1, x.shape[1], *([1] * (x.type.rank - 2)))
            dev_coef = None
            if gvar is not None:
                dev_coef = c.call("mul", gvar, c.const(2.0 / (x.type.numel // x.shape[1]), x))
                dev_coef = c.call("reshape", dev_coef, shape=kept)
            gmean_k = None if gmean is None else c.call("reshape", gmean, shape=kept)
            mean_k = c.call("reshape", mean, shape=kept)
            gx = _add_stat_cotangents(c, gx, mean_k, gmean_k, dev_coef)
        return tuple(g if need else None for g, need in zip((gx, gw, gb), c.needs, strict=True))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        return [
            Sample(
                (
                    rng.standard_normal(shape),
                    rng.standard_normal(shape[1]),
                    rng.standard_normal(shape[1]),
                ),
                {"eps": 1e-5},
            )
            for shape in ((6, 3), (2, 3, 4, 5))
        ]


@defop("batch_norm_grad")
class BatchNormGrad:
    """The gradient of batch_norm's y: inputs gy, x, w, mean, var; results gx, gw, gb.

    Forward: xhat = (x - mean) * rstd, rstd = 1/sqrt(var + eps); gb = sum(gy),
    gw = sum(gy * xhat) over axes (0, 2, ...); gx = w * rstd * (gy - gb/n - xhat * gw/n).
    Backward: none (a backward kernel).
    """

    flops = staticmethod(_flops(10))

    @staticmethod
    def infer(
        gy: TensorType,
        x: TensorType,
        w: TensorType,
        mean: TensorType,
        var: TensorType,
        *,
        eps: float,
    ) -> tuple[TensorType, ...]:
        op = "batch_norm_grad"
        dtype = float_dtype(op, gy, x, w, mean, var)
        _check_channels(op, x, weight=w, mean=mean, var=var)
        _check_eps(op, eps)
        if gy.shape != x.shape:
            raise ShapeError(f"{op}: gy {gy} and x {x} differ in shape")
        return (x, TensorType(w.shape, dtype), TensorType(w.shape, dtype))

    @staticmethod
    def kernel(
        gy: Array, x: Array, w: Array, mean: Array, var: Array, *, eps: float
    ) -> tuple[Array, Array, Array]:
        axes, nd = _bn_axes(x.ndim), x.ndim
        n = x.size // x.shape[1]
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = (x - _per_channel(mean, nd)) * _per_channel(rstd, nd)
        gb = gy.sum(axis=axes)
        gw = np.sum(gy * xhat, axis=axes)
        xhat *= _per_channel(gw / n, nd)
        gx = gy - _per_channel(gb / n, nd)
        gx -= xhat
        gx *= _per_channel(w * rstd, nd)
        return gx, gw, gb

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in BatchNorm.samples(rng):
            x, w, b = sample.inputs
            y, mean, var = BatchNorm.kernel(x, w, b, eps=1e-5)
            gy = rng.standard_normal(tuple(y.shape))
            out.append(Sample((gy, x, w, mean, var), sample.attrs))
        return out


# -- layer norm ---------------------------------------------------------------


def _check_ndim(op: str, x: TensorType, ndim: object) -> tuple[int, ...]:
    """The normalised shape x.shape[-ndim:]."""
    if not isinstance(ndim, int) or isinstance(ndim, bool) or not 1 <= ndim <= x.rank:
        raise ShapeError(f"{op}: ndim must be an int in [1, {x.rank}] for {x}, got {ndim!r}")
    return x.shape[x.rank - ndim :]


def _check_affine(op: str, normalized: tuple[int, ...], **params: TensorType) -> None:
    for name, p in params.items():
        if p.shape != normalized:
            raise ShapeError(f"{op}: {name} {p} must have the normalised shape {list(normalized)}")


def _ln_axes(x: Array, ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - ndim, x.ndim))


@defop("layer_norm")
class LayerNorm:
    """Layer normalisation over the last ``ndim`` axes, as torch.nn.functional.layer_norm;
    w and b have the normalised shape x.shape[-ndim:]. Results y, mean and rstd, the
    statistics with shape x.shape[:-ndim] + (1,) * ndim (as ATen's native_layer_norm).

    Forward: mean = mean(x), var = mean((x - mean)^2) over the last ndim axes,
    rstd = 1/sqrt(var + eps); y = (x - mean) * rstd * w + b.
    Backward: (gx, gw, gb) = layer_norm_grad(gy, x, w, mean, rstd); cotangents of mean and
    rstd add gmean/n - grstd * rstd^3 (x - mean)/n to gx (n = numel of the normalised shape).
    """

    flops = staticmethod(_flops(7))

    @staticmethod
    def infer(
        x: TensorType, w: TensorType, b: TensorType, *, eps: float, ndim: int
    ) -> tuple[TensorType, ...]:
        dtype = float_dtype("layer_norm", x, w, b)
        normalized = _check_ndim("layer_norm", x, ndim)
        _check_affine("layer_norm", normalized, weight=w, bias=b)
        _check_eps("layer_norm", eps)
        stat = TensorType((*x.shape[: x.rank - ndim], *([1] * ndim)), dtype)
        return (x, stat, stat)

    @staticmethod
    def kernel(
        x: Array, w: Array, b: Array, *, eps: float, ndim: int
    ) -> tuple[Array, Array, Array]:
        axes = _ln_axes(x, ndim)
        mean = x.mean(axis=axes, keepdims=True)
        y = x - mean
        rstd = 1.0 / np.sqrt(np.mean(np.square(y), axis=axes, keepdims=True) + eps)
        y *= rstd
        y *= w
        y += b
        return y, mean, rstd

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        x, w, _ = c.inputs
        gy, gmean, grstd = c.cts
        _, mean, rstd = c.node.outputs
        gx = gw = gb = None
        if gy is not None:
            gx, gw, gb = c.call_multi("layer_norm_grad", gy, x, w, mean, rstd, ndim=c.attrs["ndim"])
        if c.needs[0] and (gmean is not None or grstd is not None):
            dev_coef = None
            if grstd is not None:
                n = x.type.numel // mean.type.numel
                cube = c.call("mul", c.call("mul", rstd, rstd), rstd)
                dev_coef = c.call("mul", c.call("mul", grstd, cube), c.const(-1.0 / n, x))
            gx = _add_stat_cotangents(c, gx, mean, gmean, dev_coef)
        return tuple(g if need else None for g, need in zip((gx, gw, gb), c.needs, strict=True))

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        cases = (((3, 5), 1), ((2, 3, 4), 2), ((3, 4), 2))
        return [
            Sample(
                (
                    rng.standard_normal(shape),
                    rng.standard_normal(shape[len(shape) - ndim :]),
                    rng.standard_normal(shape[len(shape) - ndim :]),
                ),
                {"eps": 1e-5, "ndim": ndim},
            )
            for shape, ndim in cases
        ]


@defop("layer_norm_grad")
class LayerNormGrad:
    """The gradient of layer_norm's y: inputs gy, x, w, mean, rstd; results gx, gw, gb.

    Forward: xhat = (x - mean) * rstd, gxhat = gy * w; over the last ndim axes
    gx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)); over the leading axes
    gw = sum(gy * xhat), gb = sum(gy). Backward: none (a backward kernel).
    """

    flops = staticmethod(_flops(10))

    @staticmethod
    def infer(
        gy: TensorType,
        x: TensorType,
        w: TensorType,
        mean: TensorType,
        rstd: TensorType,
        *,
        ndim: int,
    ) -> tuple[TensorType, ...]:
        op = "layer_norm_grad"
        dtype = float_dtype(op, gy, x, w, mean, rstd)
        normalized = _check_ndim(op, x, ndim)
        _check_affine(op, normalized, weight=w)
        stat = (*x.shape[: x.rank - ndim], *([1] * ndim))
        if gy.shape != x.shape or mean.shape != stat or rstd.shape != stat:
            raise ShapeError(
                f"{op}: gy {gy} must have x's shape {list(x.shape)}, mean {mean} and "
                f"rstd {rstd} the shape {list(stat)}"
            )
        return (x, TensorType(w.shape, dtype), TensorType(w.shape, dtype))

    @staticmethod
    def kernel(
        gy: Array, x: Array, w: Array, mean: Array, rstd: Array, *, ndim: int
    ) -> tuple[Array, Array, Array]:
        axes, lead = _ln_axes(x, ndim), tuple(range(x.ndim - ndim))
        xhat = (x - mean) * rstd
        gb = gy.sum(axis=lead)
        gw = np.sum(gy * xhat, axis=lead)
        gxhat = gy * w
        gx = gxhat - gxhat.mean(axis=axes, keepdims=True)
        xhat *= np.mean(gxhat * xhat, axis=axes, keepdims=True)
        gx -= xhat
        gx *= rstd
        return gx, gw, gb

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for sample in LayerNorm.samples(rng):
            x, w, b = sample.inputs
            y, mean, rstd = LayerNorm.kernel(x, w, b, **sample.attrs)
            gy = rng.standard_normal(tuple(y.shape))
            out.append(Sample((gy, x, w, mean, rstd), {"ndim": sample.attrs["ndim"]}))
        return out
