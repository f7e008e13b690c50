"""Op families. Importing this package registers every op into the IR's registry."""

from __future__ import annotations

from pockengine.ops import (
    activation,
    attention,
    elementwise,
    indexing,
    linalg,
    nn,
    norm,
    pool,
    power,
    reduce,
    shape,
    unary,
    update,
)

__all__ = [
    "activation",
    "attention",
    "elementwise",
    "indexing",
    "linalg",
    "nn",
    "norm",
    "pool",
    "power",
    "reduce",
    "shape",
    "unary",
    "update",
]
