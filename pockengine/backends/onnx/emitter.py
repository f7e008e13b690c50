"""What the ONNX Runtime backend's kernels write through: the ``Emitter`` and its helpers.

A kernel (``Kernel``: emitter, IR node, input names, output names) adds one or a few
ONNX nodes and constant initializers to the ``Emitter``; ``onnx_dtype`` gives the
TensorProto element type of an IR dtype. ``emit`` walks a graph through the merged
kernel tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pockengine.ir import DType, Node
from pockengine.ir.registry import registrar

__all__ = [
    "IR_VERSION",
    "OPSET",
    "Emitter",
    "Kernel",
    "new_name",
    "onnx_dtype",
    "registrar",
]

OPSET = 18  # bitwise ops, ScatterND/ScatterElements reductions, Reduce* axes as inputs
IR_VERSION = 8  # the IR version that introduced opset 18: loads in any ORT >= 1.14

Kernel = Callable[["Emitter", Node, list[str], list[str]], None]

_ONNX_DTYPE = {
    DType.F32: 1,
    DType.U8: 2,
    DType.I8: 3,
    DType.I32: 6,
    DType.I64: 7,
    DType.BOOL: 9,
    DType.F16: 10,
    DType.F64: 11,
    DType.BF16: 16,
}


def onnx_dtype(dtype: DType | str) -> int:
    """The TensorProto element type of an IR dtype."""
    return _ONNX_DTYPE[DType(dtype)]


def new_name(name: str) -> str:
    """The output carrying the value an effect writes into ``name``."""
    return f"{name}:new"


class Emitter:
    """Collects ONNX nodes and constant initializers; hands out fresh tensor names."""

    def __init__(self) -> None:
        import onnx

        self.onnx = onnx
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._count = 0
        self.source = ""

    def tmp(self) -> str:
        """A fresh name (the IR's names hold no slash, so none collides)."""
        self._count += 1
        return f"t/{self._count}"

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        """Add one single-output node; returns its output's name."""
        return self.op_multi(op_type, *inputs, outs=[out or self.tmp()], **attrs)[0]

    def op_multi(self, op_type: str, *inputs: str, outs: Sequence[str], **attrs: Any) -> list[str]:
        given = {k: v for k, v in attrs.items() if v is not None}
        # named after the IR node it implements, so that onnxruntime's errors point at it
        name = f"{self.source or op_type} #{len(self.nodes)}"
        node = self.onnx.helper.make_node(op_type, list(inputs), list(outs), name=name, **given)
        self.nodes.append(node)
        return list(outs)

    def const(self, value: Any, dtype: DType | str | np.dtype[Any] | None = None) -> str:
        """An initializer holding ``value`` (equal constants are shared)."""
        array = np.asarray(value) if dtype is None else np.asarray(value, dtype=_np(dtype))
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._consts:
            name = f"c/{len(self._consts)}"
            tensor = self.onnx.numpy_helper.from_array(np.array(array, order="C"), name)
            self.initializers.append(tensor)
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant (shapes, axes, pads, slice bounds)."""
        return self.const(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def scalar(self, value: float, like: DType | str) -> str:
        """A 0-d constant of an IR dtype; elementwise ops broadcast it."""
        return self.const(value, like)


def _np(dtype: DType | str | np.dtype[Any]) -> np.dtype[Any]:
    if isinstance(dtype, np.dtype):
        return dtype
    return DType(str(dtype)).to_numpy()
