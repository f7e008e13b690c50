"""AdamW with 8-bit block-wise optimizer state (after bitsandbytes' 8-bit Adam).

Each moment tensor is stored as one byte an element plus one scale per block of
``block`` consecutive elements (the gradient's elements in row-major order; the last
block may be short): the byte indexes a 256-entry code of values in [-1, 1] (signed) or
[0, 1] (unsigned), and the value is ``code[byte] * absmax[block]``, ``absmax`` being the
block's largest magnitude. The codes are bitsandbytes' *dynamic* (tree) codes (Dettmers
et al., "8-bit Optimizers via Block-wise Quantization", 2022): a decimal exponent from
10^-6 to 10^0 and a linear fraction whose resolution grows with the exponent, so small
values keep their relative precision.

The first moment ``m`` is stored with the signed code. The second is stored as its square
root ``sqrt(v)`` with the unsigned code (bitsandbytes stores ``v`` itself): the update
divides by ``sqrt(v)`` anyway, and the root spans half as many decades as ``v``, so a
block whose elements' gradient scales differ by 10^3 keeps 16 levels a decade for its
smallest instead of 2. On such gradients that moves the weights 7x less far from float32
AdamW's (``benchmarks/optim_8bit_quality.py``, docs/quant.md "Low-bit optimizer state").

The update dequantizes both moments, applies AdamW in the param's float dtype exactly as
``adamw_update`` does, and quantizes ``m`` and ``sqrt(v)`` again with each block's new
absmax (round to the nearest code: ``searchsorted`` over the midpoints between codes).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pockengine.ir import DType, Sample, ShapeError, TensorType, defop
from pockengine.ir.arrays import Array
from pockengine.ops.update import _adam_signature, _adamw_math, _skipped, _unchanged, _write_rows

__all__ = [
    "SIGNED_CODE",
    "UNSIGNED_CODE",
    "ZERO_BYTE",
    "code_bins",
    "code_midpoints",
    "dequantize_blockwise",
    "float_keys",
    "quantize_blockwise",
]

_EXPONENTS = 7  # decimal exponents 10^-6 .. 10^0


def _dynamic_code(signed: bool) -> Array:
    """bitsandbytes' ``create_dynamic_map(signed)`` with 8 bits and 7 exponents: for
    exponent i, the midpoints of a linear grid over [0.1, 1] with 2^i (signed; 2^(i+1)
    unsigned) intervals, times 10^(i-6); then 0 and 1. Sorted, 256 float32 values."""
    values: list[float] = [0.0, 1.0]
    for i in range(_EXPONENTS):
        items = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, items + 1)
        means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - _EXPONENTS + 1)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    code = np.sort(np.asarray(values, dtype=np.float32))
    assert code.size == 256
    return code


SIGNED_CODE = _dynamic_code(signed=True)  # the first moment
UNSIGNED_CODE = _dynamic_code(signed=False)  # the second moment's square root
# the byte that stores 0.0 (the state a fresh optimizer starts from)
ZERO_BYTE = {
    "signed": int(np.flatnonzero(SIGNED_CODE == 0)[0]),
    "unsigned": int(np.flatnonzero(UNSIGNED_CODE == 0)[0]),
}


def code_midpoints(code: Array) -> Array:
    """The 255 decision boundaries of round-to-nearest: x rounds to byte
    ``searchsorted(midpoints, x)`` (the number of midpoints below it)."""
    return ((code[:-1] + code[1:]) / 2).astype(code.dtype)


def float_keys(x: Array) -> Array:
    """int32 keys of float32 values, ordered as the values are (the sign-magnitude bits
    turned into two's complement order; -0.0 sorts just below +0.0)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    return np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)


def code_bins(code: Array) -> tuple[Array, int]:
    """A faster round-to-nearest for float32: bin = float_keys(x) >> 16 (65536 bins, each
    1/128 of an octave). Returns, per bin (offset by 32768), how many midpoints lie below
    its first value, and the most midpoints any one bin holds: the byte of x is the first
    count plus the number of the bin's own midpoints below x, which equals
    ``searchsorted(midpoints, x)`` (the torch kernel's float32 path; tests check it)."""
    keys = float_keys(code_midpoints(code)).astype(np.int64)
    starts = (np.arange(1 << 16, dtype=np.int64) - (1 << 15)) << 16
    below = np.searchsorted(keys, starts, side="left").astype(np.int64)
    per_bin = np.bincount((keys >> 16) + (1 << 15), minlength=1 << 16)
    return below, int(per_bin.max())


def _blocks(x: Array, block: int) -> Array:
    """``x`` flattened, zero-padded to whole blocks, as ``[blocks, block]``."""
    flat = x.reshape(-1)
    pad = -flat.size % block
    return np.concatenate([flat, np.zeros(pad, flat.dtype)]).reshape(-1, block)


def quantize_blockwise(x: Array, code: Array, block: int) -> tuple[Array, Array]:
    """Bytes (u8, ``x``'s shape) and per-block absmax (``x``'s dtype) of ``x``."""
    blocks = _blocks(x, block)
    absmax = np.abs(blocks).max(axis=1)
    scale = np.where(absmax > 0, absmax, np.ones_like(absmax))
    normed = blocks / scale[:, None]
    mids = code_midpoints(code).astype(x.dtype)
    codes = np.searchsorted(mids, normed.reshape(-1), side="left")
    return codes[: x.size].astype(np.uint8).reshape(x.shape), absmax.astype(x.dtype)


def dequantize_blockwise(codes: Array, absmax: Array, code: Array, block: int) -> Array:
    """The values that ``quantize_blockwise`` stored, in ``absmax``'s dtype."""
    values = code.astype(absmax.dtype)[_blocks(codes, block).astype(np.intp)]
    return (values * absmax[:, None]).reshape(-1)[: codes.size].reshape(codes.shape)


def _state_types(op: str, g: TensorType, block: int, *state: TensorType) -> None:
    """Bytes shaped as the gradient; absmax ``[ceil(numel / block)]`` in its dtype."""
    if block < 1:
        raise ShapeError(f"{op}: block={block} must be >= 1")
    codes = TensorType(g.shape, DType.U8)
    absmax = TensorType((math.ceil(g.numel / block),), g.dtype)
    for got, want in zip(state, (codes, absmax, codes, absmax), strict=True):
        if got != want:
            raise ShapeError(f"{op}: optimizer state {got} should be {want} for gradient {g}")


@defop("adamw8bit_update", mutates=(0, 2, 3, 4, 5))
class AdamW8bitUpdate:
    """Effect, ``adamw_update`` with 8-bit block-wise moments (module docstring):
    m = SIGNED_CODE[mq] * ma, v = (UNSIGNED_CODE[vq] * va)^2 (per block of ``block``);
    w <- w * (1 - lr * weight_decay); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps);
    (mq, ma), (vq, va) <- quantize_blockwise(m), quantize_blockwise(sqrt(v))."""

    @staticmethod
    def infer(
        w: TensorType,
        g: TensorType,
        mq: TensorType,
        ma: TensorType,
        vq: TensorType,
        va: TensorType,
        t: TensorType,
        lr: TensorType,
        skip: TensorType | None = None,
        *,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        block: int,
        rows: int | None = None,
    ) -> tuple[TensorType, ...]:
        op = "adamw8bit_update"
        _adam_signature(op, w, g, rows, t, lr, skip)
        if not g.dtype.is_float:
            raise ShapeError(f"{op} needs a float gradient, got {g}")
        _state_types(op, g, block, mq, ma, vq, va)
        return ()

    @staticmethod
    def kernel(
        w: Array,
        g: Array,
        mq: Array,
        ma: Array,
        vq: Array,
        va: Array,
        t: Array,
        lr: Array,
        skip: Array | None = None,
        *,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        block: int,
        rows: int | None = None,
    ) -> tuple[Array, ...]:
        if _skipped(skip):
            return _unchanged(w, mq, ma, vq, va)
        m = dequantize_blockwise(mq, ma, SIGNED_CODE, block)
        root = dequantize_blockwise(vq, va, UNSIGNED_CODE, block)
        part, m, _, root = _adamw_math(
            w,
            g,
            m,
            root * root,
            float(t),
            float(lr),
            rows,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
        )
        return (
            _write_rows(w, rows, part),
            *quantize_blockwise(m, SIGNED_CODE, block),
            *quantize_blockwise(root, UNSIGNED_CODE, block),
        )

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: object, attrs: object) -> int:
        # adamw_update's 12, two dequantizations (2 each) and the square of the root, two
        # quantizations (abs, max, divide and an 8-step binary search: ~11 each)
        return 39 * ins[1].numel

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        attrs: dict[str, Any] = {
            "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "block": 4,
        }  # fmt: skip
        w, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))

        def state(rows: int) -> tuple[Array, ...]:
            m = 0.1 * rng.standard_normal((rows, 5))
            root = 0.01 * rng.random((rows, 5))  # sqrt(v)
            m[0, :4] = root[0, :4] = 0.0  # a block of zeros (absmax 0)
            return (*quantize_blockwise(m, SIGNED_CODE, 4),
                    *quantize_blockwise(root, UNSIGNED_CODE, 4),
                    np.asarray(3.0), np.asarray(1e-3))  # fmt: skip

        skip, keep = np.asarray(1.0, np.float32), np.asarray(0.0, np.float32)
        full = state(3)
        return [
            Sample((w, g, *full), attrs),
            Sample((w, g[:2], *state(2)), {**attrs, "rows": 2}),
            Sample((w, g, *full, skip), attrs),
            Sample((w, g, *full, keep), attrs),
        ]
