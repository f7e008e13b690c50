"""Operands of the graph-walking frontends (ONNX, Keras) and the ``Ctx`` their converters use.

An operand is an IR ``Value`` (computed at run time), a NumPy array (known at compile time:
a constant, a shape, or anything computed only from those) or None (an absent optional
input). The drivers fold every node whose inputs are all known, so converters see at least
one ``Value``; ``Ctx.value`` turns a known operand into a graph value (a ``full`` when it is
uniform, a ``const`` input otherwise).
"""

from __future__ import annotations

import re

import numpy as np

from pockengine.frontend.context import EmitContext
from pockengine.frontend.rng import DropoutSeed
from pockengine.ir import CompileError, DType, GraphBuilder, Role, TensorType, Value
from pockengine.ir.arrays import Array

__all__ = ["CONST_DTYPES", "Ctx", "Operand", "sanitize"]

Operand = Value | Array | None

# The dtypes a constant operand may have (float16 and bfloat16 models must be cast first).
CONST_DTYPES = frozenset({DType.F32, DType.I32, DType.I64, DType.BOOL, DType.F64})


def sanitize(name: str) -> str:
    """An IR value name for a model's name: ``\\w[\\w.]*`` (torch names pass unchanged)."""
    clean = re.sub(r"[^\w.]", "_", name)
    return clean if clean and (clean[0].isalnum() or clean[0] == "_") else f"v{clean}"


class Ctx(EmitContext):
    """What converters use: the builder, the current node's name, constants, the rng."""

    def __init__(self, b: GraphBuilder) -> None:
        super().__init__(b)
        self.opset = 18  # the model's default-domain opset; the driver sets it
        self.n_outputs = 1  # of the node being converted
        self.values: dict[str, Array] = {}  # const and rng inputs created while converting
        self.eval_modules: frozenset[str] = frozenset()
        self.module_of: dict[str, str] = {}  # IR param name -> module path
        self.rng = DropoutSeed(b)

    # -- emitting ------------------------------------------------------------------

    # -- operands ------------------------------------------------------------------
    def value(self, x: Operand, what: str = "input") -> Value:
        """``x`` as a graph value: constants become a ``full`` or a ``const`` input."""
        if isinstance(x, Value):
            return x
        if x is None:
            raise CompileError(f"the {what} is missing")
        array = np.asarray(x)
        dtype = DType.from_numpy(array.dtype) if array.dtype.kind != "U" else None
        if dtype is None or dtype not in CONST_DTYPES:
            raise CompileError(f"a constant of dtype {array.dtype} is not supported")
        flat = array.reshape(-1)
        if flat.size and np.all(flat == flat[0]) and not np.isnan(flat[0]):
            scalar = flat[0].item()
            return self.full(scalar, dtype, tuple(array.shape))
        name = self.b.fresh("const.")
        self.values[name] = np.array(array, copy=True)
        value = Value(name, TensorType(tuple(array.shape), dtype), Role.CONST)
        self.b.inputs.append(value)
        return value

    def like(self, x: Operand, other: Value) -> Value:
        """``x`` (often a constant) as a value of ``other``'s dtype."""
        if isinstance(x, np.ndarray):
            x = np.asarray(x, dtype=other.dtype.to_numpy())
        return self.cast(self.value(x), other.dtype)

    # -- dropout -------------------------------------------------------------------
    def random_mask(self, shape: tuple[int, ...], p: float) -> Value:
        return self.rng.mask(shape, p, self.source)

    def dropout(self, x: Value, p: float) -> tuple[Value, Value]:
        """Dropout of ``x`` at rate ``p`` > 0 and its bool keep-mask (``rng.dropout``)."""
        return self.rng.dropout(x, p, self.source)

    def finish_rng(self) -> None:
        """Advance the dropout seed once per step, after every mask has been drawn."""
        self.rng.finish()
        self.values.update(self.rng.initial_values())
