"""Sliding-window geometry shared by convolution and pooling (NCHW, as ATen), and
the dtype rule of the neural-network ops.

A window op reads, for output position (oh, ow) and kernel tap (i, j), the
input element (oh*sh - ph + i*dh, ow*sw - pw + j*dw). The kernels pad the
input once and then take one strided slice per tap, so that every tap is one
vectorised NumPy operation over the whole batch; backward kernels scatter-add
into a padded zero array the same way and crop the padding off.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import DType, ShapeError, TensorType
from pockengine.ir.arrays import Array
from pockengine.ops._common import same_dtype

__all__ = ["Pair", "Window", "check_pair", "conv_out_size", "float_dtype", "pool_out_size"]

Pair = tuple[int, int]


def check_pair(op: str, name: str, value: object, minimum: int) -> Pair:
    """``value`` as a pair of ints, each at least ``minimum``; a ShapeError otherwise."""
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ShapeError(f"{op}: {name} must be a pair of ints, got {value!r}")
    if min(value) < minimum:
        raise ShapeError(f"{op}: {name} must be at least {minimum}, got {value!r}")
    return (value[0], value[1])


def float_dtype(op: str, *types: TensorType) -> DType:
    """The one floating-point dtype of ``types`` (window and norm ops compute in it)."""
    dtype = same_dtype(op, *types)
    if not dtype.is_float:
        raise ShapeError(f"{op} needs floating-point inputs, got {dtype}")
    return dtype


def conv_out_size(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """floor((size + 2*pad - dilation*(kernel-1) - 1) / stride) + 1."""
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def pool_out_size(
    size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool
) -> int:
    """ATen's pooling_output_shape: with ceil_mode the division rounds up, but the
    last window must still start inside the input or its left padding."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@dataclass(frozen=True, slots=True)
class Window:
    """The windows of one op over the last two axes of an input of spatial size ``in_hw``."""

    in_hw: Pair
    out_hw: Pair
    kernel: Pair
    stride: Pair
    padding: Pair
    dilation: Pair

    def taps(self) -> Iterator[tuple[int, int, int]]:
        """(t, i, j) for every kernel tap in row-major order: t = i*kw + j."""
        for i in range(self.kernel[0]):
            for j in range(self.kernel[1]):
                yield i * self.kernel[1] + j, i, j

    def tap(self, i: int, j: int) -> tuple[slice, slice]:
        """The slices of the padded input that tap (i, j) reads, one per output position."""
        return (self._tap(0, i), self._tap(1, j))

    def _tap(self, axis: int, k: int) -> slice:
        start = k * self.dilation[axis]
        step = self.stride[axis]
        return slice(start, start + step * (self.out_hw[axis] - 1) + 1, step)

    def _after(self, axis: int) -> int:
        # With ceil_mode the last window may reach past the right padding: pad that far.
        reach = (self.out_hw[axis] - 1) * self.stride[axis]
        reach += self.dilation[axis] * (self.kernel[axis] - 1) + 1
        return max(self.padding[axis], reach - self.in_hw[axis] - self.padding[axis])

    def pad(self, x: Array, value: float) -> Array:
        """``x`` padded on its last two axes so that every tap's slice is in bounds."""
        after = (self._after(0), self._after(1))
        if self.padding == (0, 0) and after == (0, 0):
            return x
        lead = [(0, 0)] * (x.ndim - 2)
        pads = [*lead, (self.padding[0], after[0]), (self.padding[1], after[1])]
        return np.pad(x, pads, constant_values=value)

    def zeros_padded(self, lead: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        """Zeros shaped like the padded input, for backward kernels to scatter into."""
        h = self.in_hw[0] + self.padding[0] + self._after(0)
        w = self.in_hw[1] + self.padding[1] + self._after(1)
        return np.zeros((*lead, h, w), dtype)

    def crop(self, xp: Array) -> Array:
        """The input region of a padded array, contiguous."""
        (h, w), (ph, pw) = self.in_hw, self.padding
        return np.ascontiguousarray(xp[..., ph : ph + h, pw : pw + w])
