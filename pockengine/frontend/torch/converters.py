"""The flat converter table of the PyTorch frontend: core ATen overload -> IR ops.

Each converter receives the translated arguments (IR values for tensors,
Python values for the rest) and returns the IR value(s) of the ATen node.
Binary ops cast their operands to the dtype that ATen's promotion gave the
result (read from the exported node's metadata), so IR ops see equal dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pockengine.frontend.context import EmitContext
from pockengine.frontend.rng import DropoutSeed
from pockengine.ir import CompileError, DType, GraphBuilder, TensorType, Value

__all__ = [
    "CONVERTERS",
    "IGNORED",
    "Ctx",
    "aten",
    "axes_of",
    "ir_dtype",
    "ir_type",
    "norm_dim",
    "promote",
]

Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}
# Ops with no effect on values: runtime assertions of the exported program.
IGNORED = frozenset(
    {
        "aten._assert_tensor_metadata.default",
        "aten._assert_scalar.default",
        "aten.sym_constrain_range_for_size.default",
    }
)


def ir_dtype(dtype: Any) -> DType:
    import torch

    table = {
        torch.float32: DType.F32,
        torch.float64: DType.F64,
        torch.float16: DType.F16,
        torch.bfloat16: DType.BF16,
        torch.int64: DType.I64,
        torch.int32: DType.I32,
        torch.bool: DType.BOOL,
    }
    if dtype not in table:
        raise CompileError(f"dtype {dtype} is not supported (use float32, int64, int32 or bool)")
    return table[dtype]


def ir_type(fake: Any) -> TensorType:
    return TensorType(tuple(int(d) for d in fake.shape), ir_dtype(fake.dtype))


class Ctx(EmitContext):
    """What converters use: the builder, the current node's metadata and source."""

    def __init__(self, b: GraphBuilder) -> None:
        super().__init__(b)
        self.out: Any = None  # the exported node's FakeTensor (or tuple of them)
        self.original = ""  # the op the exported node was decomposed from ("" if none)
        self.node: Any = None  # the exported node itself (its inputs' strides, for as_strided)
        self.rng = DropoutSeed(b)

    # -- metadata ------------------------------------------------------------
    @property
    def out_type(self) -> TensorType:
        fake = self.out[0] if isinstance(self.out, list | tuple) else self.out
        return ir_type(fake)

    # -- emitting --------------------------------------------------------------

    def tensor(self, x: Value | float | bool, dtype: DType) -> Value:
        """A tensor operand of ``dtype``: casts a value, makes a 0-d constant of a scalar."""
        if isinstance(x, Value):
            return self.cast(x, dtype)
        if isinstance(x, bool | int | float):
            return self.full(x, dtype)
        raise CompileError(f"unsupported operand {x!r}")

    # -- dropout randomness ----------------------------------------------------
    def random_mask(self, shape: tuple[int, ...], p: float) -> Value:
        return self.rng.mask(shape, p, self.source)

    def dropout(self, x: Value, p: float) -> tuple[Value, Value]:
        """Dropout of ``x`` at rate ``p`` > 0 and its bool keep-mask (``rng.dropout``)."""
        return self.rng.dropout(x, p, self.source)

    def finish_rng(self) -> None:
        """Advance the dropout seed once per step, after every mask has been drawn."""
        self.rng.finish()


_C = TypeVar("_C", bound=Converter)


def aten(*names: str) -> Callable[[_C], _C]:
    """Register one converter for the listed ATen overloads."""

    def wrap(fn: _C) -> _C:
        for name in names:
            CONVERTERS[f"aten.{name}"] = fn
        return fn

    return wrap


def promote(*xs: Any) -> DType:
    """The common dtype of comparison operands (tensors decide; scalars only lift kind)."""
    tensors = [x.dtype for x in xs if isinstance(x, Value)]
    floats = [d for d in tensors if d.is_float]
    if floats:
        return max(floats, key=lambda d: d.itemsize)
    if any(isinstance(x, float) for x in xs):
        return DType.F32
    ints = [d for d in tensors if d is not DType.BOOL]
    if ints:
        return max(ints, key=lambda d: d.itemsize)
    return (
        DType.I64 if any(isinstance(x, int) and not isinstance(x, bool) for x in xs) else DType.BOOL
    )


def axes_of(dims: int | Sequence[int] | None, rank: int) -> tuple[int, ...] | None:
    if dims is None:
        return None
    seq = [dims] if isinstance(dims, int) else list(dims)
    return tuple(d % max(rank, 1) for d in seq) or None


def norm_dim(dim: int, rank: int) -> int:
    return dim % max(rank, 1)
