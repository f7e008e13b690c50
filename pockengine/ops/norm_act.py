"""Batch norm fused with the hardtanh (relu6) after it, and its backward kernel.

``batch_norm_hardtanh(x, w, b, eps, min_val, max_val)`` is ``hardtanh(batch_norm(x, w,
b)[0])`` with batch norm's statistics as its other two results: the normalised tensor is
never stored. ``batch_norm_hardtanh_grad(gz, x, w, b, mean, var, ...)`` is
``batch_norm_grad(hardtanh_grad(gz, y), x, w, mean, var)`` with ``y`` the normalised
tensor recomputed from ``x`` and the saved statistics inside the kernel, so neither ``y``
nor the masked gradient is stored. The C backend rewrites the unfused chains into these
after autodiff (``backends/c/fuse_bn.py``), and a batch norm that rematerialisation
repeats in the backward pass into ``batch_norm_apply(x, w, b, mean, var, ...)``, which
reads the statistics the forward pass saved instead of computing them again. The NumPy
kernels are the unfused definitions.
"""

from __future__ import annotations

import numpy as np

from pockengine.ir import Fact, Sample, ShapeError, TensorType, defop
from pockengine.ir.arrays import Array
from pockengine.ops.norm import BatchNorm, BatchNormGrad

__all__: list[str] = []


def _check_bounds(op: str, min_val: object, max_val: object) -> None:
    for name, v in (("min_val", min_val), ("max_val", max_val)):
        if not isinstance(v, float | int) or isinstance(v, bool):
            raise ShapeError(f"{op}: {name} must be a number, got {v!r}")


def _per_channel(v: Array, ndim: int) -> Array:
    return v.reshape(-1, *([1] * (ndim - 2)))


def _normalised(x: Array, w: Array, b: Array, mean: Array, var: Array, eps: float) -> Array:
    """batch_norm's y from its saved statistics, by the same operations as its kernel."""
    y = x - _per_channel(mean, x.ndim)
    y *= _per_channel(w / np.sqrt(var + eps), x.ndim)
    y += _per_channel(b, x.ndim)
    return y


def _samples(rng: np.random.Generator) -> list[tuple[Array, Array, Array]]:
    """(x, w, b) whose normalised values fall on both sides of the bounds 0 and 1."""
    out = []
    for shape in ((6, 3), (2, 3, 4, 5)):
        x = rng.standard_normal(shape)
        out.append((x, rng.standard_normal(shape[1]), rng.standard_normal(shape[1])))
    return out


@defop("batch_norm_hardtanh", facts=Fact.CHEAP)
class BatchNormHardtanh:
    """Training-mode batch norm, then hardtanh: results z, mean and the biased variance.

    Forward: (y, mean, var) = batch_norm(x, w, b); z = min(max(y, min_val), max_val).
    Made after autodiff (the C backend's rewrite), so it has no VJP; its backward is
    batch_norm_hardtanh_grad.
    """

    @staticmethod
    def infer(
        x: TensorType, w: TensorType, b: TensorType, *, eps: float, min_val: float, max_val: float
    ) -> tuple[TensorType, ...]:
        _check_bounds("batch_norm_hardtanh", min_val, max_val)
        return BatchNorm.infer(x, w, b, eps=eps)

    @staticmethod
    def kernel(
        x: Array, w: Array, b: Array, *, eps: float, min_val: float, max_val: float
    ) -> tuple[Array, Array, Array]:
        y, mean, var = BatchNorm.kernel(x, w, b, eps=eps)
        z = np.minimum(np.maximum(y, min_val), max_val).astype(y.dtype, copy=False)
        return z, mean, var

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 9 * ins[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        bounds = {"eps": 1e-5, "min_val": 0.0, "max_val": 1.0}
        return [Sample(xwb, bounds) for xwb in _samples(rng)]


@defop("batch_norm_hardtanh_grad")
class BatchNormHardtanhGrad:
    """The gradient through hardtanh(batch_norm(x, w, b)): inputs gz, x, w, b, mean, var
    (batch_norm's saved statistics); results gx, gw, gb.

    Forward: y = (x - mean) / sqrt(var + eps) * w + b; gy = gz where min_val < y < max_val,
    else 0; (gx, gw, gb) = batch_norm_grad(gy, x, w, mean, var).
    Backward: none (a backward kernel).
    """

    @staticmethod
    def infer(
        gz: TensorType,
        x: TensorType,
        w: TensorType,
        b: TensorType,
        mean: TensorType,
        var: TensorType,
        *,
        eps: float,
        min_val: float,
        max_val: float,
    ) -> tuple[TensorType, ...]:
        _check_bounds("batch_norm_hardtanh_grad", min_val, max_val)
        BatchNorm.infer(x, w, b, eps=eps)
        return BatchNormGrad.infer(gz, x, w, mean, var, eps=eps)

    @staticmethod
    def kernel(
        gz: Array,
        x: Array,
        w: Array,
        b: Array,
        mean: Array,
        var: Array,
        *,
        eps: float,
        min_val: float,
        max_val: float,
    ) -> tuple[Array, Array, Array]:
        y = _normalised(x, w, b, mean, var, eps)
        gy = np.where((y > min_val) & (y < max_val), gz, np.zeros((), gz.dtype))
        return BatchNormGrad.kernel(gy, x, w, mean, var, eps=eps)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 14 * ins[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for x, w, b in _samples(rng):
            _, mean, var = BatchNorm.kernel(x, w, b, eps=1e-5)
            gz = np.asarray(rng.standard_normal(x.shape))
            attrs = {"eps": 1e-5, "min_val": 0.0, "max_val": 1.0}
            out.append(Sample((gz, x, w, b, mean, var), attrs))
        return out


@defop("batch_norm_apply", facts=Fact.CHEAP)
class BatchNormApply:
    """Batch norm's output from statistics it is given (a rematerialised batch norm in the
    backward pass, whose statistics the forward pass saved), clipped when both bounds are
    numbers: inputs x, w, b, mean, var; attributes eps, min_val, max_val (None: no clip).

    Forward: y = (x - mean) / sqrt(var + eps) * w + b; z = min(max(y, min_val), max_val).
    Made after autodiff (the C backend's rewrite), so it has no VJP.
    """

    @staticmethod
    def infer(
        x: TensorType,
        w: TensorType,
        b: TensorType,
        mean: TensorType,
        var: TensorType,
        *,
        eps: float,
        min_val: float | None,
        max_val: float | None,
    ) -> TensorType:
        if (min_val is None) != (max_val is None):
            raise ShapeError("batch_norm_apply: give both bounds or neither")
        if min_val is not None:
            _check_bounds("batch_norm_apply", min_val, max_val)
        BatchNorm.infer(x, w, b, eps=eps)
        BatchNormGrad.infer(x, x, w, mean, var, eps=eps)
        return x

    @staticmethod
    def kernel(
        x: Array,
        w: Array,
        b: Array,
        mean: Array,
        var: Array,
        *,
        eps: float,
        min_val: float | None,
        max_val: float | None,
    ) -> Array:
        y = _normalised(x, w, b, mean, var, eps)
        if min_val is None or max_val is None:
            return y
        return np.minimum(np.maximum(y, min_val), max_val).astype(y.dtype, copy=False)

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: object) -> int:
        return 4 * ins[0].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        out = []
        for (x, w, b), bounds in zip(_samples(rng), ((0.0, 1.0), (None, None)), strict=True):
            _, mean, var = BatchNorm.kernel(x, w, b, eps=1e-5)
            attrs = {"eps": 1e-5, "min_val": bounds[0], "max_val": bounds[1]}
            out.append(Sample((x, w, b, mean, var), attrs))
        return out
