"""How the torch backend lays out the tensors it stores, and the check that what a step
writes in place is dense, made once per tensor."""

from __future__ import annotations

import weakref

import torch

__all__ = ["is_dense", "stored_layout"]


def stored_layout(tensor: torch.Tensor, channels_last: bool = True) -> torch.memory_format:
    """The layout of the tensors this backend copies in (``from_numpy``: trained params,
    buffers, optimizer state, batch tensors): channels-last for 4-D (NHWC: images, conv
    weights and their optimizer state) unless turned off, so convolutions, batch norm and
    pointwise kernels take oneDNN's fast paths and propagate that layout; row-major for the
    rest. Values the step only reads are shared as they arrive (``share_numpy``). The IR's
    shapes stay logical (NCHW); only strides differ."""
    return torch.channels_last if channels_last and tensor.dim() == 4 else torch.contiguous_format


_DENSE_FORMATS = (torch.contiguous_format, torch.channels_last)
# the tensors found dense, by id, held weakly: an entry goes with its tensor, so an id
# reused by a later tensor is never mistaken for it (a WeakSet would compare tensors with
# ``==``, elementwise)
_DENSE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is row-major or channels-last (dense, as the fused optimizer
    kernels index it), checked once per tensor: the store's tensors keep their strides
    from step to step (nothing in the engine restrides one in place), so each step's run
    looks the answer up instead of asking ATen twice per written tensor."""
    if _DENSE.get(id(tensor)) is tensor:
        return True
    if not any(tensor.is_contiguous(memory_format=f) for f in _DENSE_FORMATS):
        return False
    _DENSE[id(tensor)] = tensor
    return True
