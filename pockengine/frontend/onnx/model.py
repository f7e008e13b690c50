"""Reading an ONNX model and sorting its initializers into params, buffers and constants.

The roles come from the ``InputSpec.kind`` metadata that ``torch.onnx.export(dynamo=True)``
writes (params, persistent buffers; the exporter's other tensors are constants), else from
``params=`` (names or globs), else float tensors of rank >= 1 are params and the rest
constants; the running statistics of BatchNormalization are buffers in every case. An
``Identity`` of an initializer (the TorchScript exporter shares equal tensors that way)
becomes its own initializer under the Identity's output name.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.frontend.onnx.converters import sanitize
from pockengine.ir import CompileError, Role
from pockengine.ir.arrays import Array

__all__ = ["OnnxModel", "OnnxNode", "load_onnx", "require_onnx"]

log = logging.getLogger(__name__)
_SIGNATURE_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_PERSISTENT = "pkg.torch.export.graph_signature.InputSpec.persistent"


@dataclass(frozen=True)
class OnnxNode:
    op_type: str
    domain: str
    name: str  # the node's name, or "#index op_type" when it has none
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    proto: Any


@dataclass
class OnnxModel:
    """A loaded model: nodes, batch inputs, outputs and sorted initializers."""

    opset: int
    nodes: list[OnnxNode]
    inputs: list[tuple[str, int, tuple[int | None, ...]]]  # name, element type, dims
    outputs: list[str]
    initializers: dict[str, Array]
    roles: dict[str, Role]  # PARAM, BUFFER or CONST for each initializer
    ir_names: dict[str, str] = field(default_factory=dict)  # param/buffer -> IR name


def require_onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise CompileError("the ONNX frontend needs onnx: pip install onnx onnxruntime") from exc
    return onnx


def _read(source: Any) -> Any:
    onnx = require_onnx()
    if isinstance(source, str | os.PathLike):
        try:
            return onnx.load(os.fspath(source))
        except Exception as exc:
            raise CompileError(f"cannot read ONNX model {os.fspath(source)!r}: {exc}") from exc
    if type(source).__name__ == "ModelProto":
        return source
    raise CompileError(f"expected a path to an .onnx file or a ModelProto, got {type(source)}")


def _nodes(graph: Any, onnx: Any) -> list[OnnxNode]:
    out = []
    for i, n in enumerate(graph.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        name = n.name or f"#{i} {n.op_type}"
        out.append(OnnxNode(n.op_type, n.domain, name, tuple(n.input), tuple(n.output), attrs, n))
    return out


def _signature_kinds(graph: Any) -> dict[str, tuple[str, str]]:
    """(kind, persistent) of each initializer that torch's dynamo exporter annotated."""
    found = {}
    for info in [*graph.value_info, *graph.input]:
        meta = {p.key: p.value for p in info.metadata_props}
        if _SIGNATURE_KIND in meta:
            found[info.name] = (meta[_SIGNATURE_KIND], meta.get(_PERSISTENT, "None"))
    return found


def _roles(
    model: OnnxModel, kinds: dict[str, tuple[str, str]], params: Iterable[str] | None
) -> dict[str, Role]:
    stats = {
        n.inputs[i]
        for n in model.nodes
        if n.op_type == "BatchNormalization"
        for i in (3, 4)
        if len(n.inputs) > i
    }
    patterns = list(params) if params is not None else None
    roles, unannotated = {}, []
    for name, array in model.initializers.items():
        floating = array.dtype.kind == "f"
        if patterns is not None:
            role = Role.PARAM if any(fnmatch.fnmatchcase(name, p) for p in patterns) else Role.CONST
        elif name in kinds:
            kind, persistent = kinds[name]
            role = {"PARAMETER": Role.PARAM, "BUFFER": Role.BUFFER}.get(kind, Role.CONST)
            role = Role.CONST if role is Role.BUFFER and persistent == "False" else role
        elif kinds:  # torch annotated its params: the rest was computed by the exporter
            role = Role.CONST
            unannotated += [name] if floating and array.ndim >= 2 else []
        else:
            role = Role.PARAM if floating and array.ndim >= 1 else Role.CONST
        if name in stats and floating:
            role = Role.BUFFER
        if role is not Role.CONST and not floating:
            role = Role.CONST
        roles[name] = role
    if unannotated:
        log.warning(
            "%d float tensors of this model are no torch parameter (e.g. %s): they stay "
            "constant. The exporter folded weights into them: export with "
            "torch.onnx.export(..., optimize=False) to train them, or pass params=[...]",
            len(unannotated),
            unannotated[:3],
        )
    return roles


def load_onnx(source: Any, params: Iterable[str] | None = None) -> OnnxModel:
    """Read an ONNX model (a path or a ModelProto) and sort its initializers."""
    onnx = require_onnx()
    proto = _read(source)
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    inits = {t.name: np.array(onnx.numpy_helper.to_array(t)) for t in graph.initializer}
    nodes, copies = [], {}
    for node in _nodes(graph, onnx):
        # the TorchScript exporter shares equal tensors through Identity: give each its own
        if node.op_type == "Identity" and node.inputs[0] in inits and node.outputs[0] not in inits:
            inits[node.outputs[0]] = inits[node.inputs[0]].copy()
            copies[node.outputs[0]] = node.inputs[0]
            continue
        nodes.append(node)
    inputs = []
    for v in graph.input:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        inputs.append((v.name, t.elem_type, dims))
    model = OnnxModel(opset, nodes, inputs, [o.name for o in graph.output], inits, {})
    kinds = _signature_kinds(graph)
    for copy, source in copies.items():
        if source in kinds:
            kinds.setdefault(copy, kinds[source])
    model.roles = _roles(model, kinds, params)
    taken: set[str] = set()
    for name, role in model.roles.items():
        if role is not Role.CONST:
            ir = sanitize(name)
            while ir in taken:
                ir += "_"
            taken.add(ir)
            model.ir_names[name] = ir
    return model
