"""Layout conversion of a 4-D activation: ``layout_convert`` between NCHW, NHWC (channels
last) and NCHW{c}c (channels blocked by ``c``: [N, ceil(C/c), H, W, c], the last block
padded with zeros).

The IR's convolutions and normalisations read NCHW; a backend that has kernels for
another layout (the C backend's ``backends/c/layout.py``) brackets them with these
conversions. The op only moves data, so its gradient is the inverse conversion.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pockengine.ir import Fact, Sample, ShapeError, TensorType, Value, VJPContext, defop
from pockengine.ir.arrays import Array

__all__ = ["LAYOUTS", "block_of", "from_nchw", "logical_shape", "shape_in", "to_nchw"]

LAYOUTS = ("NCHW", "NHWC")  # and "NCHW{c}c" for any block c >= 2
_BLOCKED = re.compile(r"NCHW([0-9]+)c")


def block_of(op: str, layout: object) -> int:
    """0 for NCHW, -1 for NHWC, the block c of NCHW{c}c; a ShapeError for anything else."""
    if layout == "NCHW":
        return 0
    if layout == "NHWC":
        return -1
    match = _BLOCKED.fullmatch(layout) if isinstance(layout, str) else None
    if match is None or int(match.group(1)) < 2:
        raise ShapeError(f"{op}: layout {layout!r} is not NCHW, NHWC or NCHW{{c}}c (c >= 2)")
    return int(match.group(1))


def shape_in(layout: str, n: int, c: int, h: int, w: int) -> tuple[int, ...]:
    """The shape of an (n, c, h, w) activation laid out as ``layout``."""
    block = block_of("layout_convert", layout)
    if block == 0:
        return (n, c, h, w)
    if block < 0:
        return (n, h, w, c)
    return (n, -(-c // block), h, w, block)


def logical_shape(layout: str, shape: tuple[int, ...], channels: int) -> tuple[int, ...]:
    """The (n, c, h, w) of an activation of ``shape`` laid out as ``layout`` with
    ``channels`` channels; a ShapeError when the shape does not fit."""
    rank = 5 if block_of("layout_convert", layout) > 0 else 4
    if len(shape) != rank:
        raise ShapeError(f"layout_convert: a {layout} input has rank {rank}, got {list(shape)}")
    if layout == "NHWC":
        nchw = (shape[0], shape[3], shape[1], shape[2])
    else:
        nchw = (shape[0], channels, shape[2], shape[3])
    if shape_in(layout, *nchw) != tuple(shape) or nchw[1] != channels:
        raise ShapeError(
            f"layout_convert: shape {list(shape)} is not a {layout} activation of "
            f"{channels} channels"
        )
    return nchw


def to_nchw(x: Array, layout: str, channels: int) -> Array:
    """``x`` (an activation of ``channels`` channels laid out as ``layout``) in NCHW."""
    block = block_of("layout_convert", layout)
    if block == 0:
        return x
    if block < 0:
        return np.transpose(x, (0, 3, 1, 2))
    n, blocks, h, w, _ = x.shape
    full = np.transpose(x, (0, 1, 4, 2, 3)).reshape(n, blocks * block, h, w)
    return full[:, :channels]


def from_nchw(x: Array, layout: str) -> Array:
    """An NCHW activation ``x`` laid out as ``layout`` (a blocked one zero-padded)."""
    block = block_of("layout_convert", layout)
    if block == 0:
        return x
    if block < 0:
        return np.transpose(x, (0, 2, 3, 1))
    n, c, h, w = x.shape
    blocks = -(-c // block)
    padded = np.zeros((n, blocks * block, h, w), x.dtype)
    padded[:, :c] = x
    return np.transpose(padded.reshape(n, blocks, block, h, w), (0, 1, 3, 4, 2))


@defop("layout_convert", facts=Fact.SHAPE)
class LayoutConvert:
    """The same 4-D activation of ``channels`` channels, laid out as ``dst`` instead of
    ``src`` (each of NCHW, NHWC, NCHW{c}c; a blocked layout pads its last block with
    zeros, which the conversion back drops).

    Forward: z = relayout(x, src -> dst).
    Backward: gx = layout_convert(gz, src=dst, dst=src) (a permutation, or a padding
    whose adjoint drops the padded entries).
    """

    @staticmethod
    def flops(ins: object, outs: object, attrs: object) -> int:
        return 0

    @staticmethod
    def infer(x: TensorType, *, src: str, dst: str, channels: int) -> TensorType:
        if src == dst:
            raise ShapeError(f"layout_convert: src and dst are both {src!r}")
        block_of("layout_convert", dst)
        nchw = logical_shape(src, x.shape, channels)
        return TensorType(shape_in(dst, *nchw), x.dtype)

    @staticmethod
    def kernel(x: Array, *, src: str, dst: str, channels: int) -> Array:
        return np.ascontiguousarray(from_nchw(to_nchw(x, src, channels), dst))

    @staticmethod
    def vjp(c: VJPContext) -> Sequence[Value | None]:
        src, dst, channels = c.attrs["src"], c.attrs["dst"], c.attrs["channels"]
        return (c.call("layout_convert", c.ct, src=dst, dst=src, channels=channels),)

    @staticmethod
    def samples(rng: np.random.Generator) -> list[Sample]:
        x = rng.standard_normal((2, 5, 3, 4))
        nhwc = np.transpose(x, (0, 2, 3, 1)).copy()
        blocked = from_nchw(x, "NCHW4c")
        return [
            Sample((x,), {"src": "NCHW", "dst": "NHWC", "channels": 5}),
            Sample((nhwc,), {"src": "NHWC", "dst": "NCHW", "channels": 5}),
            Sample((x,), {"src": "NCHW", "dst": "NCHW4c", "channels": 5}),
            Sample((blocked,), {"src": "NCHW4c", "dst": "NCHW", "channels": 5}),
            Sample((nhwc,), {"src": "NHWC", "dst": "NCHW4c", "channels": 5}),
        ]
