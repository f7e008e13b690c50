"""Low-bit frozen weights: the ``dequantize`` op and the NumPy quantizers that make its inputs.

A quantized weight is stored as integer codes plus one scale (and, for ``int4``, one
offset) per group of ``group`` consecutive elements along the last axis:

- ``int8``: ``w = scale * c`` with ``c`` an i8 code in [-127, 127] (symmetric). With
  ``group`` = the row length it is the per-output-channel int8 of ``pe.compile(...,
  frozen_dtype="int8")``; with ``group=32`` and f16 scales it is GGUF's Q8_0.
- ``int4``: ``w = scale * c + offset`` with ``c`` in [0, 15] (asymmetric): the group-wise
  int4 of ``frozen_dtype="int4"``, and GGUF's Q4_1 (group 32, f16 scales and offsets).
- ``int4_sym``: ``w = scale * (c - 8)`` with ``c`` in [0, 15]: GGUF's Q4_0.

4-bit codes are packed two a byte (u8), in GGUF's order within a group: byte ``j`` holds
element ``j`` in its low nibble and element ``j + group/2`` in its high nibble, so GGUF's
blocks are these codes as they are. Codes ``[..., C]`` (int8) or ``[..., C/2]`` (4-bit),
scales and offsets ``[..., C/group]``; the result is ``[..., C]`` in the scales' dtype
(f16/bf16 scales, as GGUF stores them, give an f32 result).

A quantized tensor is frozen: ``dequantize`` has ``Fact.NO_GRADIENT`` (no cotangent to
the codes or scales) and ``Fact.CHEAP`` (rematerialisation recomputes it at its backward
reader instead of keeping the float weight alive across the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import DType, Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array

__all__ = [
    "SCHEMES",
    "Quantized",
    "dequantize_array",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "unpack_int4",
]

SCHEMES = ("int8", "int4", "int4_sym")
_CODE_DTYPE = {"int8": DType.I8, "int4": DType.U8, "int4_sym": DType.U8}
_WIDE = (DType.F16, DType.BF16)  # scales stored narrow; the result is f32


@dataclass(frozen=True, slots=True)
class Quantized:
    """One quantized tensor: the inputs of ``dequantize`` and its attributes."""

    codes: Array
    scales: Array
    offsets: Array | None
    scheme: str
    group: int

    @property
    def arrays(self) -> tuple[Array, ...]:
        extra = () if self.offsets is None else (self.offsets,)
        return (self.codes, self.scales, *extra)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _columns(scheme: str, codes: TensorType) -> int:
    return codes.shape[-1] * (1 if scheme == "int8" else 2)


def _check(
    scheme: str, group: int, codes: TensorType, scales: TensorType, offsets: TensorType | None
) -> None:
    if scheme not in SCHEMES:
        raise ShapeError(f"unknown scheme {scheme!r}; one of {SCHEMES}")
    if codes.dtype is not _CODE_DTYPE[scheme]:
        raise ShapeError(f"{scheme} codes are {_CODE_DTYPE[scheme]}, got {codes}")
    if (offsets is not None) != (scheme == "int4"):
        raise ShapeError(f"{scheme} {'needs' if scheme == 'int4' else 'takes no'} offsets")
    if codes.rank < 1 or group < 2 or group % 2:
        raise ShapeError(f"codes of rank >= 1 and an even group >= 2, got {codes}, {group}")
    cols = _columns(scheme, codes)
    if cols % group:
        raise ShapeError(f"{cols} columns are not whole groups of {group}")
    want = (*codes.shape[:-1], cols // group)
    for t in (scales, offsets):
        if t is not None and (t.shape != want or not t.dtype.is_float):
            raise ShapeError(f"scales and offsets are float {list(want)}, got {t}")
    if offsets is not None and offsets.dtype is not scales.dtype:
        raise ShapeError(f"offsets {offsets} have another dtype than scales {scales}")


def unpack_int4(codes: Array, group: int) -> Array:
    """Packed bytes ``[..., C/2]`` -> codes ``[..., C]`` (u8 in [0, 15]), GGUF's order."""
    *lead, half = codes.shape
    g = codes.reshape(*lead, half * 2 // group, group // 2)
    return np.concatenate([g & 0x0F, g >> 4], axis=-1).reshape(*lead, half * 2)


def pack_int4(q: Array, group: int) -> Array:
    """Codes ``[..., C]`` in [0, 15] -> bytes ``[..., C/2]``; the inverse of unpack_int4."""
    *lead, cols = q.shape
    g = q.astype(np.uint8).reshape(*lead, cols // group, 2, group // 2)
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*lead, cols // 2)


def dequantize_array(
    codes: Array, scales: Array, offsets: Array | None, *, scheme: str, group: int
) -> Array:
    """The float tensor the codes stand for (the NumPy reference of ``dequantize``)."""
    dtype = np.float32 if scales.dtype == np.float16 else scales.dtype
    q = codes if scheme == "int8" else unpack_int4(codes, group)
    *lead, cols = q.shape
    w = q.reshape(*lead, cols // group, group).astype(dtype)
    if scheme == "int4_sym":
        w -= 8
    w *= scales.astype(dtype)[..., None]
    if offsets is not None:
        w += offsets.astype(dtype)[..., None]
    return np.asarray(w.reshape(*lead, cols))


def _groups(w: Array, group: int) -> Array:
    *lead, cols = w.shape
    if cols % group:
        raise ValueError(f"a row of {cols} is not whole groups of {group}")
    return w.reshape(*lead, cols // group, group)


def quantize_int8(w: Array, group: int | None = None) -> Quantized:
    """Symmetric int8, one scale per ``group`` elements of a row (None: per row, i.e. per
    output channel of a ``[out, in]`` weight): ``scale = max|w| / 127``."""
    group = group or w.shape[-1]
    g = _groups(np.asarray(w, dtype=np.float32), group)
    scales = np.abs(g).max(axis=-1) / 127
    scales[scales == 0] = 1  # an all-zero group: codes 0
    codes = np.clip(np.rint(g / scales[..., None]), -127, 127).astype(np.int8)
    return Quantized(codes.reshape(w.shape), scales.astype(np.float32), None, "int8", group)


def quantize_int4(w: Array, group: int = 32) -> Quantized:
    """Asymmetric 4-bit per ``group`` elements of a row: ``offset = min``, ``scale =
    (max - min) / 15``, codes ``rint((w - offset) / scale)`` packed two a byte."""
    g = _groups(np.asarray(w, dtype=np.float32), group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scales = (high - low) / 15
    scales[scales == 0] = 1
    q = np.clip(np.rint((g - low[..., None]) / scales[..., None]), 0, 15)
    codes = pack_int4(q.reshape(w.shape), group)
    return Quantized(codes, scales.astype(np.float32), low.astype(np.float32), "int4", group)


@defop("dequantize", facts=Fact.NO_GRADIENT | Fact.CHEAP)
class Dequantize:
    """Low-bit codes to floats, per group of ``group`` elements along the last axis:
    int8: w = s * c; int4: w = s * c + m; int4_sym: w = s * (c - 8) (4-bit codes two a
    byte). Result [..., C] in the scales' dtype (f32 for f16/bf16 scales).

    A quantized weight is frozen: no cotangent reaches the codes, scales or offsets; the
    activation gradient flows through the result as through any matmul operand.
    """

    @staticmethod
    def infer(
        codes: TensorType, scales: TensorType, *offsets: TensorType, scheme: str, group: int
    ) -> TensorType:
        if len(offsets) > 1:
            raise ShapeError(f"at most one offsets tensor, got {len(offsets)}")
        _check(scheme, group, codes, scales, offsets[0] if offsets else None)
        dtype = DType.F32 if scales.dtype in _WIDE else scales.dtype
        return TensorType((*codes.shape[:-1], _columns(scheme, codes)), dtype)

    @staticmethod
    def kernel(codes: Array, scales: Array, *offsets: Array, scheme: str, group: int) -> Array:
        return dequantize_array(
            codes, scales, offsets[0] if offsets else None, scheme=scheme, group=group
        )

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        return len(ins) * outs[0].numel  # a multiply, and an add per offset or -8

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        return tuple(None for _ in c.inputs)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        w = rng.standard_normal((4, 16))
        i8, i4 = quantize_int8(w), quantize_int4(w, group=8)
        sym = rng.integers(0, 256, (3, 2, 8), dtype=np.uint8)
        f64 = np.float64
        int4 = (i4.codes, *(a.astype(f64) for a in i4.arrays[1:]))
        return [
            Sample((i8.codes, i8.scales.astype(f64)), {"scheme": "int8", "group": 16}),
            Sample((i8.codes, rng.random((4, 4))), {"scheme": "int8", "group": 4}),
            Sample(int4, {"scheme": "int4", "group": 8}),
            Sample((sym, rng.random((3, 2, 2))), {"scheme": "int4_sym", "group": 8}),
        ]
