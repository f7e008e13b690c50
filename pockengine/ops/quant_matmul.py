"""Products with a low-bit frozen matrix: ``dequantize_matmul``.

``dequantize_matmul(x, codes, scales[, offsets], scheme, group, transpose)`` is
``matmul(x, W^T)`` (``transpose=True``, a linear layer's forward ``X W^T``) or
``matmul(x, W)`` (``transpose=False``, its input gradient ``dY W``) with ``W =
dequantize(codes, scales[, offsets])`` a ``[R, C]`` matrix. A backend whose kernel reads
the codes as it packs them never holds the float matrix: the C backend rewrites
``matmul(x, transpose(dequantize(...)))`` and ``matmul(x, dequantize(...))`` into it
(``backends/c/fuse_lowbit.py``). The NumPy kernel is the unfused definition.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pockengine.ir import Sample, ShapeError, TensorType, defop
from pockengine.ir.arrays import Array
from pockengine.ops.quant import Dequantize, dequantize_array, quantize_int4, quantize_int8

__all__: list[str] = []


@defop("dequantize_matmul")
class DequantizeMatmul:
    """Product with a dequantized [R, C] matrix W (``dequantize``'s rules and attributes):
    transpose: z = x @ W^T (x [..., C] -> [..., R]); else z = x @ W (x [..., R] -> [..., C]).

    Made after autodiff (a backend's rewrite of dequantize + matmul), so it has no VJP;
    its x-gradient would be the same op with ``transpose`` flipped.
    """

    @staticmethod
    def infer(
        x: TensorType,
        codes: TensorType,
        scales: TensorType,
        *offsets: TensorType,
        scheme: str,
        group: int,
        transpose: bool,
    ) -> TensorType:
        w = Dequantize.infer(codes, scales, *offsets, scheme=scheme, group=group)
        if w.rank != 2 or x.rank < 2:
            raise ShapeError(f"dequantize_matmul needs a matrix and x of rank >= 2: {x}, {w}")
        if x.dtype is not w.dtype:
            raise ShapeError(f"dequantize_matmul: x {x} and the matrix {w} differ in dtype")
        inner, outer = (w.shape[1], w.shape[0]) if transpose else w.shape
        if x.shape[-1] != inner:
            raise ShapeError(f"inner sizes differ: {x} @ {w}{'^T' if transpose else ''}")
        return TensorType((*x.shape[:-1], outer), x.dtype)

    @staticmethod
    def kernel(
        x: Array,
        codes: Array,
        scales: Array,
        *offsets: Array,
        scheme: str,
        group: int,
        transpose: bool,
    ) -> Array:
        w = dequantize_array(
            codes, scales, offsets[0] if offsets else None, scheme=scheme, group=group
        )
        return np.asarray(np.matmul(x, w.T if transpose else w))

    @staticmethod
    def flops(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Any) -> int:
        return 2 * outs[0].numel * ins[0].shape[-1]

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        w = rng.standard_normal((6, 16))
        i8, i4 = quantize_int8(w, 8), quantize_int4(w, group=8)
        f64 = np.float64
        int4 = (i4.codes, *(a.astype(f64) for a in i4.arrays[1:]))
        return [
            Sample((rng.standard_normal((3, 16)), i8.codes, i8.scales.astype(f64)),
                   {"scheme": "int8", "group": 8, "transpose": True}),
            Sample((rng.standard_normal((2, 3, 6)), *int4),
                   {"scheme": "int4", "group": 8, "transpose": False}),
        ]  # fmt: skip
