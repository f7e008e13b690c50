"""Torch kernels of ``random_mask``, and the dropout keep-mask fused into it.

``random_mask(seed, shape, p, salt)`` is a counter hash (``ops.elementwise``): element i
is kept when ``mix(mix(i ^ key) ...)`` / 2**32 >= p, all in 32-bit unsigned arithmetic.
Here the hash runs on int32 tensors: multiplication wraps modulo 2**32 as the unsigned one
does, a logical right shift is an arithmetic one masked to the bits shifted in, and the
unsigned comparison ``h >= t`` is the signed ``h ^ 2**31 >= t - 2**31``. int32 holds twice
the elements of int64 per vector and multiplies natively, so the hash costs about half of
the int64 one; chunks of ``MASK_CHUNK`` elements keep its scratch in cache.

Fused keep-mask: the frontends lower a dropout to ``keep = ne(random_mask(...), 0)`` (the
bool mask the backward keeps, ``frontend.rng``). ``FINDERS`` pairs each such ``ne`` with
its ``random_mask``: the mask's kernel writes the bool ``keep`` straight from the hash
into the pair's hidden local (``random_keep``), and the ``ne`` hands it on. The float32
mask is then never made, unless something else reads it. ``keep`` is the same bits as
``ne(mask, 0)``: a kept element's mask value is 1/(1-p) > 0, a dropped one's 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pockengine.backends.torch.codegen import Emit, Emitter, GraphIndex, literal
from pockengine.ir import Node

__all__ = ["FINDERS", "MASK_CHUNK", "NAMESPACE", "keep_or", "mix_int", "random_keep"]

_M32 = 0xFFFFFFFF
_SIGN = 1 << 31
# Elements hashed at once: two int32 scratch chunks of 256 KiB stay in cache (about 4x
# faster than whole-mask temporaries, and no int64 arange of the largest mask).
MASK_CHUNK = 1 << 16


def mix_int(h: int) -> int:
    """random_mask's mix of one value in [0, 2**32)."""
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x6A09E667) & _M32
    return h ^ (h >> 16)


def _mix_tensor(h: torch.Tensor) -> torch.Tensor:
    """``mix_int`` on an int64 tensor of values in [0, 2**32) (the 0-d seed key)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x6A09E667) & _M32
    return h ^ (h >> 16)


def _mix32_into(h: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``mix_int`` in place on int32 ``h`` holding uint32 bits; shifts go to ``scratch``."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x6A09E667)):
        torch.bitwise_right_shift(h, shift, out=scratch).bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(scratch).mul_(factor)
    torch.bitwise_right_shift(h, 16, out=scratch).bitwise_and_(0xFFFF)
    return h.bitwise_xor_(scratch)


def _hashes(seed: torch.Tensor, salt_key: int, n: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, h) per chunk of the n < 2**32 elements: h the int32 hash of elements start,
    start+1, ... with its sign bit flipped (so a signed compare is the unsigned one). The
    element index i < 2**32 is its own low word (i & M = i, i >> 32 = 0), so the key is
    ``mix(mix(salt_key ^ seed_lo) ^ seed_hi)`` for the whole mask."""
    key = _mix_tensor(_mix_tensor(salt_key ^ (seed & _M32)) ^ ((seed >> 32) & _M32))
    key32 = (key - ((key >> 31) << 32)).to(torch.int32)  # the same 32 bits, signed
    size = max(1, min(n, MASK_CHUNK))
    h = torch.empty(size, dtype=torch.int32, device=seed.device)
    scratch = torch.empty_like(h)
    for start in range(0, n, size):  # a chunk never straddles 2**31 (size divides it)
        m = min(size, n - start)
        first = start - (1 << 32) if start >= _SIGN else start  # index i as int32 bits
        torch.arange(first, first + m, out=h[:m]).bitwise_xor_(key32)
        _mix32_into(_mix32_into(h[:m], scratch[:m]), scratch[:m])
        yield start, h[:m].bitwise_xor_(-_SIGN)


def random_keep(
    seed: torch.Tensor, salt_key: int, threshold: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """The bool keep-mask of random_mask, bit for bit: element i is kept when its hash h
    has h >= ``threshold`` = ceil(p * 2**32) (exact: both sides are integers)."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.bool, device=seed.device)
    if threshold > _M32:  # p >= 1: nothing kept
        return out.fill_(False).reshape(shape)
    for start, h in _hashes(seed, salt_key, n):
        torch.ge(h, threshold - _SIGN, out=out[start : start + h.numel()])
    return out.reshape(shape)


def random_mask(
    seed: torch.Tensor, salt_key: int, threshold: int, scale: float, shape: tuple[int, ...]
) -> torch.Tensor:
    """random_mask's float mask: ``scale`` where ``random_keep`` keeps, 0 elsewhere."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if threshold > _M32:
        return out.fill_(0.0).reshape(shape)
    kept = torch.empty(min(n, MASK_CHUNK), dtype=torch.bool, device=seed.device)
    for start, h in _hashes(seed, salt_key, n):
        m = h.numel()
        torch.mul(torch.ge(h, threshold - _SIGN, out=kept[:m]), scale, out=out[start : start + m])
    return out.reshape(shape)


def _keep_partner(node: Node, index: GraphIndex) -> Node | None:
    """For ``ne(random_mask(...), 0)``: the random_mask node, whose kernel makes the keep."""
    mask = index.producers.get(node.inputs[0].name)
    zero = index.producers.get(node.inputs[1].name)
    if mask is None or mask.op != "random_mask" or zero is None or zero.op != "full":
        return None
    return mask if zero.attrs["shape"] == () and zero.attrs["value"] == 0 else None


def _random_mask(e: Emit) -> list[str]:
    shape, p, salt = tuple(e.attr("shape")), float(e.attr("p")), int(e.attr("salt"))
    if math.prod(shape) >= 2**32:
        raise NotImplementedError("random_mask of 2**32 elements or more")
    threshold = math.ceil(p * 2.0**32)  # p * 2**32 is exact: a power-of-two scaling
    scale = float(np.float32(1.0 / (1.0 - p) if p < 1.0 else 0.0))
    key = f"{e.ins[0]}, {mix_int(salt & _M32)}, {threshold}"
    if e.saved is None:  # no ne(mask, 0) reads it
        return [f"{e.out} = random_mask({key}, {literal(scale)}, {literal(shape)})"]
    stmts = [f"{e.saved} = random_keep({key}, {literal(shape)})"]
    mask = e.node.output
    keep_only = mask not in e.graph.outputs and all(
        _keep_partner(r, e.index) is e.node for r in e.readers()
    )
    mask_of_keep = f"aten_mul({e.saved}, {literal(scale)})"  # bool * float -> float32
    stmts.append(f"{e.out} = None" if keep_only else f"{e.out} = {mask_of_keep}")
    return stmts


def keep_or(plain: Emitter) -> Emitter:
    """The ``ne`` kernel: a keep-mask its random_mask made, else ``plain``."""

    def emit(e: Emit) -> list[str]:
        return [f"{e.out} = {e.saved}"] if e.saved is not None else plain(e)

    return emit


KERNELS: dict[str, Emitter] = {"random_mask": _random_mask}

FINDERS = {"ne": _keep_partner}

NAMESPACE: dict[str, Any] = {"random_mask": random_mask, "random_keep": random_keep}
