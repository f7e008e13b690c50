"""IR graph -> one ONNX model of standard operators (opset 18).

``emit_onnx(graph)`` writes every IR node as one or a few ONNX nodes, using the kernel
tables of ``kernels`` and ``kernels_nn``. The model's inputs are the graph's
inputs, in order; its outputs are the graph's outputs followed by the new value of every
param, buffer and state that an effectful node writes (named ``<name>:new``; the IR's
names never hold a colon). Nothing is updated in place: whoever runs the model carries
those outputs over as the next step's inputs.

The emitter is pure: it needs the ``onnx`` package to build the protobuf, never
onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import CompileError, DType, Graph, Node, UnsupportedOpError, get_op
from pockengine.ir.registry import registrar

__all__ = [
    "IR_VERSION",
    "OPSET",
    "Emitter",
    "Kernel",
    "OnnxSignature",
    "emit_onnx",
    "new_name",
    "onnx_dtype",
    "registrar",
]

OPSET = 18  # bitwise ops, ScatterND/ScatterElements reductions, Reduce* axes as inputs
IR_VERSION = 8  # the IR version that introduced opset 18: loads in any ORT >= 1.14

Array = np.ndarray[Any, Any]
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


@dataclass(frozen=True)
class OnnxSignature:
    """How a training-step model is called.

    ``inputs`` are the graph inputs in order, ``outputs`` the graph outputs, and
    ``updates`` maps each written input to the model output holding its new value.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    updates: dict[str, str]


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


def kernel_table() -> dict[str, Kernel]:
    from pockengine.backends.onnx import kernels as onnx_kernels
    from pockengine.backends.onnx import kernels_attn as onnx_kernels_attn
    from pockengine.backends.onnx import kernels_loss as onnx_kernels_loss
    from pockengine.backends.onnx import kernels_nn as onnx_kernels_nn
    from pockengine.backends.onnx import kernels_quant as onnx_kernels_quant
    from pockengine.backends.onnx import kernels_select as onnx_kernels_select
    from pockengine.backends.onnx import kernels_shape as onnx_kernels_shape

    return {
        **onnx_kernels.KERNELS,
        **onnx_kernels_shape.KERNELS,
        **onnx_kernels_nn.KERNELS,
        **onnx_kernels_attn.KERNELS,
        **onnx_kernels_loss.KERNELS,
        **onnx_kernels_quant.KERNELS,
        **onnx_kernels_select.KERNELS,
    }


def _value_info(onnx: Any, name: str, dtype: DType, shape: tuple[int, ...]) -> Any:
    return onnx.helper.make_tensor_value_info(name, onnx_dtype(dtype), list(shape))


def _emit_nodes(em: Emitter, graph: Graph) -> dict[str, str]:
    """Every node's ONNX nodes; returns each written input's new-value output."""
    kernels = kernel_table()
    missing = {(n.op, n.source): None for n in graph.nodes if n.op not in kernels}
    if missing:
        raise UnsupportedOpError("ops for the onnxruntime backend", list(missing))
    updates: dict[str, str] = {}
    for node in graph.nodes:
        em.source = f"{node.op} at {node.source}" if node.source else node.op
        opdef = get_op(node.op)
        if opdef.effectful:
            written = [node.inputs[i].name for i in opdef.mutates]
            outs = [new_name(n) for n in written]
            updates.update(zip(written, outs, strict=True))
        else:
            outs = [v.name for v in node.outputs]
        try:  # IR names are valid ONNX names: inputs and results keep them
            kernels[node.op](em, node, [v.name for v in node.inputs], outs)
        except CompileError as exc:
            raise CompileError(f"{node.op} at {node.source or '?'}: {exc}") from exc
    em.source = ""
    return updates


def _graph_outputs(em: Emitter, graph: Graph) -> list[str]:
    inputs = {v.name for v in graph.inputs}
    outputs: list[str] = []
    for v in graph.outputs:
        name = v.name
        if name in inputs or name in outputs:  # an ONNX output must be a node's own result
            name = em.op("Identity", name, out=f"{v.name}:out{len(outputs)}")
        outputs.append(name)
    return outputs


def emit_onnx(graph: Graph, metadata: dict[str, str] | None = None) -> tuple[Any, OnnxSignature]:
    """The ONNX model of ``graph`` (see the module docstring) and its signature."""
    import onnx

    em = Emitter()
    updates = _emit_nodes(em, graph)
    outputs = _graph_outputs(em, graph)
    by_name = {v.name: v for v in graph.inputs}
    out_infos = [
        _value_info(onnx, n, v.dtype, v.shape) for n, v in zip(outputs, graph.outputs, strict=True)
    ]
    out_infos += [
        _value_info(onnx, new, by_name[old].dtype, by_name[old].shape)
        for old, new in updates.items()
    ]
    in_infos = [_value_info(onnx, v.name, v.dtype, v.shape) for v in graph.inputs]
    onnx_graph = onnx.helper.make_graph(
        em.nodes, graph.name, in_infos, out_infos, initializer=em.initializers
    )
    model = onnx.helper.make_model(
        onnx_graph,
        opset_imports=[onnx.helper.make_opsetid("", OPSET)],
        producer_name="pockengine",
        ir_version=IR_VERSION,
    )
    for key, value in (metadata or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    signature = OnnxSignature(tuple(v.name for v in graph.inputs), tuple(outputs), dict(updates))
    return model, signature
