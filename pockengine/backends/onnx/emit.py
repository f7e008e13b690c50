"""IR graph -> one ONNX model of standard operators (opset 18).

``emit_onnx(graph)`` writes every IR node as one or a few ONNX nodes, through the
``Emitter`` (``emitter``), using the kernel tables of ``kernels`` and ``kernels_*``, merged
here (``KERNELS``). The model's inputs are the graph's inputs, in order; its outputs are
the graph's outputs followed by the new value of every param, buffer and state that an
effectful node writes (named ``<name>:new``; the IR's names never hold a colon). Nothing
is updated in place: whoever runs the model carries those outputs over as the next step's
inputs.

The emitter is pure: it needs the ``onnx`` package to build the protobuf, never
onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pockengine.backends.onnx import (
    kernels,
    kernels_attn,
    kernels_loss,
    kernels_nn,
    kernels_quant,
    kernels_select,
    kernels_shape,
)
from pockengine.backends.onnx.emitter import (
    IR_VERSION,
    OPSET,
    Emitter,
    Kernel,
    new_name,
    onnx_dtype,
)
from pockengine.ir import CompileError, DType, Graph, UnsupportedOpError, get_op

__all__ = ["KERNELS", "OnnxSignature", "emit_onnx", "kernel_table"]


@dataclass(frozen=True)
class OnnxSignature:
    """How a training-step model is called.

    ``inputs`` are the graph inputs in order, ``outputs`` the graph outputs, and
    ``updates`` maps each written input to the model output holding its new value.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    updates: dict[str, str]


KERNELS: dict[str, Kernel] = {
    **kernels.KERNELS,
    **kernels_shape.KERNELS,
    **kernels_nn.KERNELS,
    **kernels_attn.KERNELS,
    **kernels_loss.KERNELS,
    **kernels_quant.KERNELS,
    **kernels_select.KERNELS,
}


def kernel_table() -> dict[str, Kernel]:
    """Op name -> its kernel, every table merged."""
    return KERNELS


def _value_info(onnx: Any, name: str, dtype: DType, shape: tuple[int, ...]) -> Any:
    return onnx.helper.make_tensor_value_info(name, onnx_dtype(dtype), list(shape))


def _emit_nodes(em: Emitter, graph: Graph) -> dict[str, str]:
    """Every node's ONNX nodes; returns each written input's new-value output."""
    missing = {(n.op, n.source): None for n in graph.nodes if n.op not in KERNELS}
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
            KERNELS[node.op](em, node, [v.name for v in node.inputs], outs)
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
