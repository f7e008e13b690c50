"""Tensor types, values, nodes and graphs: the frozen vocabulary of the IR.

A graph is an ordered, typed, straight-line program (like a jaxpr). Values are
identified by their names, which are unique within a graph; graph inputs carry
a role (input, param, buffer, const, state) so that nothing in the engine ever
picks parameters by matching name strings. ``print_graph`` writes a graph as text, one
node per line; ``ir.parser`` reads the same text back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

__all__ = [
    "AttrValue",
    "Attrs",
    "DType",
    "Graph",
    "Node",
    "Phase",
    "Role",
    "TensorType",
    "Value",
    "print_graph",
    "print_node",
]


class DType(StrEnum):
    """Element types. The short names are what the printer writes."""

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    F64 = "f64"
    I8 = "i8"  # quantized weight codes (symmetric int8)
    U8 = "u8"  # quantized weight codes (two 4-bit codes a byte)
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"

    @property
    def is_float(self) -> bool:
        return self in (DType.F16, DType.BF16, DType.F32, DType.F64)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    def to_numpy(self) -> np.dtype[Any]:
        if self is DType.BF16:
            raise TypeError("bf16 has no NumPy dtype; the NumPy backend computes in f32")
        return np.dtype(_NUMPY_NAME[self])

    @staticmethod
    def from_numpy(dtype: np.dtype[Any] | type) -> DType:
        name = np.dtype(dtype).name
        for member, np_name in _NUMPY_NAME.items():
            if np_name == name:
                return member
        raise TypeError(f"no IR dtype for NumPy dtype {name!r}")


_ITEMSIZE = {
    DType.F16: 2,
    DType.BF16: 2,
    DType.F32: 4,
    DType.F64: 8,
    DType.I8: 1,
    DType.U8: 1,
    DType.I32: 4,
    DType.I64: 8,
    DType.BOOL: 1,
}
_NUMPY_NAME = {
    DType.F16: "float16",
    DType.F32: "float32",
    DType.F64: "float64",
    DType.I8: "int8",
    DType.U8: "uint8",
    DType.I32: "int32",
    DType.I64: "int64",
    DType.BOOL: "bool",
}


@dataclass(frozen=True, slots=True)
class TensorType:
    """A static shape and an element type; a scalar has shape ()."""

    shape: tuple[int, ...]
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))  # a tenth of np.prod's time; passes ask often

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def replace(self, **changes: Any) -> TensorType:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


class Role(StrEnum):
    """What a graph input is. Node results have no role."""

    INPUT = "input"  # a batch tensor, fed every step
    PARAM = "param"  # a model parameter; trainable or frozen
    BUFFER = "buffer"  # a model buffer (BatchNorm running statistics, ...)
    CONST = "const"  # a constant tensor lifted out of the model
    STATE = "state"  # optimizer and engine state (moments, step count, lr, rng)


class Phase(StrEnum):
    """Which part of a training step a node belongs to; set by whoever emits it (autodiff
    marks the backward, the optimizer its updates), never read from ``source`` text."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclass(frozen=True, slots=True)
class Value:
    """An SSA value: a graph input (with a role) or the result of one node."""

    name: str
    type: TensorType
    role: Role | None = None
    trainable: bool = False  # meaningful for params only

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def replace(self, **changes: Any) -> Value:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.name if self.role is not None else f"%{self.name}"


AttrValue = int | float | bool | str | None | tuple[Any, ...]


class Attrs(Mapping[str, AttrValue]):
    """An immutable, hashable, ordered mapping of node attributes."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, AttrValue] | None = None, /, **kwargs: AttrValue):
        merged = dict(items or {})
        merged.update(kwargs)
        self._items: tuple[tuple[str, AttrValue], ...] = tuple(
            (k, _freeze(v)) for k, v in merged.items()
        )

    def __getitem__(self, key: str) -> AttrValue:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return f"Attrs({dict(self._items)!r})"

    def replace(self, **changes: AttrValue) -> Attrs:
        return Attrs(dict(self._items), **changes)


def _freeze(value: Any) -> AttrValue:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, StrEnum):
        return str(value)
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Node:
    """One operation. Effectful ops write some of their inputs in place (see OpDef.mutates)."""

    op: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    attrs: Attrs = field(default_factory=Attrs)
    source: str = ""  # where it came from: module path, source line, or "autodiff"
    phase: Phase = Phase.FORWARD

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def replace(self, **changes: Any) -> Node:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Graph:
    """An ordered straight-line program: inputs, nodes in execution order, outputs."""

    name: str
    inputs: tuple[Value, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Value, ...]

    def replace(self, **changes: Any) -> Graph:
        return dataclasses.replace(self, **changes)

    def inputs_with_role(self, *roles: Role) -> tuple[Value, ...]:
        return tuple(v for v in self.inputs if v.role in roles)

    @property
    def params(self) -> tuple[Value, ...]:
        return self.inputs_with_role(Role.PARAM)

    @property
    def trainable_params(self) -> tuple[Value, ...]:
        return tuple(v for v in self.params if v.trainable)

    def input_named(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        raise KeyError(f"graph {self.name} has no input named {name!r}")

    def producers(self) -> dict[str, Node]:
        """Map from each node result's name to the node that makes it."""
        return {out.name: node for node in self.nodes for out in node.outputs}

    def users(self) -> dict[str, list[Node]]:
        """Map from each value's name to the nodes that read it, in order."""
        found: dict[str, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                found.setdefault(v.name, []).append(node)
        return found

    def __str__(self) -> str:
        return print_graph(self)


# -- the text format (``ir.parser`` reads it back) ----------------------------------------


def _input_decl(v: Value) -> str:
    role = str(v.role)
    if v.role is Role.PARAM and not v.trainable:
        role = "param(frozen)"
    return f"{v.name}: {v.type} {role}"


def print_node(node: Node) -> str:
    args = [str(v) for v in node.inputs]
    args += [f"{k}={v!r}" for k, v in node.attrs.items()]
    call = f"{node.op}({', '.join(args)})"
    if node.outputs:
        lhs = ", ".join(f"%{v.name}: {v.type}" for v in node.outputs)
        line = f"{lhs} = {call}"
    else:
        line = f"! {call}"
    if node.phase is not Phase.FORWARD:  # forward is the default and is not written
        line = f"{line} @{node.phase}"
    return f"{line}  # {node.source}" if node.source else line


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name}("]
    lines += [f"    {_input_decl(v)}," for v in graph.inputs]
    lines.append(") {")
    lines += [f"  {print_node(n)}" for n in graph.nodes]
    lines.append(f"  return {', '.join(str(v) for v in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)
