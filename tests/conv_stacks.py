"""Small torch CNNs of 3x3 convolutions that the C backend's convolution tests train: a
stack of stride-1 convolutions with ReLU (batch norm after some), global average pooling
and a linear head, with PyTorch's own initialisation, and their batches."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

__all__ = ["conv_stack"]


def conv_stack(
    widths: Sequence[int],
    size: int,
    batch: int,
    count: int,
    norm_after: Collection[int] = (),
    classes: int = 5,
) -> tuple[Any, Callable[..., Any], list[tuple[Any, Any]]]:
    """3x3 convolutions from 3 channels to each of ``widths`` (padding 1, ReLU; batch norm
    before the ReLU of the convolutions numbered in ``norm_after``), pooled, a linear head
    to ``classes``; the cross-entropy loss; ``count`` batches of ``batch`` images of
    ``size`` x ``size``. Seeded: the same model and batches every call."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    cin = 3
    for k, width in enumerate(widths):
        layers.append(nn.Conv2d(cin, width, 3, padding=1))
        if k in norm_after:
            layers.append(nn.BatchNorm2d(width))
        layers.append(nn.ReLU())
        cin = width
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    g = torch.Generator().manual_seed(1)
    shape = (batch, 3, size, size)
    return (
        model,
        loss_fn,
        [
            (torch.randn(shape, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(count)
        ],
    )
