"""ModelInfo of an ONNX model, for schemes: what torch's module tree would have said.

- module path: the param's name up to its last dot (``encoder.layer.1.output.dense``);
- module type: from the op that consumes the param, looking through Transpose, Cast,
  Reshape and friends (Conv -> Conv2d, Gemm/MatMul -> Linear, BatchNormalization ->
  BatchNorm2d, LayerNormalization -> LayerNorm, Gather -> Embedding); a module whose last
  name component says "norm" (LLaMA's RMSNorm weights feed a Mul) is a Norm;
- containers: every path whose children are numbered (``layers.0``, ``layers.1``), the
  blocks the one with most numbered children (ties: most parameters);
- head: the module of the last Gemm/MatMul weight in node order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from pockengine.frontend.imported import ModelInfo, ParamInfo
from pockengine.ir import Role

if TYPE_CHECKING:
    from pockengine.frontend.onnx.model import OnnxModel, OnnxNode

__all__ = ["model_info"]

_MODULE_TYPES = {
    "Conv": "Conv2d",
    "ConvTranspose": "ConvTranspose2d",
    "Gemm": "Linear",
    "MatMul": "Linear",
    "BatchNormalization": "BatchNorm2d",
    "LayerNormalization": "LayerNorm",
    "Gather": "Embedding",
}
_THROUGH = frozenset(
    {"Transpose", "Identity", "Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", "Flatten"}
)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _consumer(name: str, readers: dict[str, list[tuple[int, OnnxNode]]]) -> tuple[int, str]:
    """(node index, op type) of the first op that uses the tensor, through view-like ops."""
    seen = {name}
    while True:
        users = readers.get(name, [])
        if not users:
            return -1, ""
        index, node = users[0]
        if node.op_type not in _THROUGH or not node.outputs or node.outputs[0] in seen:
            return index, node.op_type
        name = node.outputs[0]
        seen.add(name)


def _containers(
    paths: list[str], sizes: dict[str, int]
) -> tuple[dict[str, tuple[str, ...]], str | None]:
    children: dict[str, dict[int, str]] = defaultdict(dict)
    weight: dict[str, int] = defaultdict(int)
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                parent = ".".join(parts[:i])
                children[parent][int(part)] = ".".join(parts[: i + 1])
                weight[parent] += sizes.get(path, 0)
    containers = {p: tuple(c[k] for k in sorted(c)) for p, c in children.items() if len(c) >= 2}
    blocks = max(containers, key=lambda p: (len(containers[p]), weight[p]), default=None)
    return containers, blocks


def model_info(model: OnnxModel) -> ModelInfo:
    readers: dict[str, list[tuple[int, OnnxNode]]] = defaultdict(list)
    for index, node in enumerate(model.nodes):
        for name in node.inputs:
            readers[name].append((index, node))
    params: list[ParamInfo] = []
    head: tuple[int, str] | None = None
    sizes: dict[str, int] = defaultdict(int)
    for name, role in model.roles.items():
        if role is not Role.PARAM:
            continue
        ir, shape = model.ir_names[name], tuple(model.initializers[name].shape)
        index, op = _consumer(name, readers)
        kind = _MODULE_TYPES.get(op, "")
        module = _module(ir)
        if not kind and "norm" in module.rsplit(".", 1)[-1].lower():
            kind = "Norm"
        params.append(ParamInfo(ir, shape, module, kind, True))
        sizes[module] += int(model.initializers[name].size)
        if op in ("Gemm", "MatMul") and len(shape) == 2 and (head is None or index > head[0]):
            head = (index, module)
    containers, blocks = _containers(sorted({p.module for p in params}), sizes)
    return ModelInfo(tuple(params), containers, head[1] if head else None, blocks)
