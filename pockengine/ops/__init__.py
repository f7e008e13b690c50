"""Op families. Importing this package registers every op into the IR's registry."""

from __future__ import annotations

from pockengine.ops import (
    activation,
    attention,
    elementwise,
    fused_loss,
    indexing,
    linalg,
    nn,
    norm,
    norm_act,
    pool,
    power,
    quant,
    quant_loss,
    quant_matmul,
    reduce,
    select,
    shape,
    unary,
    update,
    update_8bit,
)

__all__ = [
    "activation",
    "attention",
    "elementwise",
    "fused_loss",
    "indexing",
    "linalg",
    "nn",
    "norm",
    "norm_act",
    "pool",
    "power",
    "quant",
    "quant_loss",
    "quant_matmul",
    "reduce",
    "select",
    "shape",
    "unary",
    "update",
    "update_8bit",
]
