"""The IR: types, Graph/Node/Value, the op registry, builder, verify, the text format.

This package is the ground floor: it imports nothing else of the engine.
"""

from __future__ import annotations

from pockengine.ir.builder import GraphBuilder
from pockengine.ir.errors import (
    CompileError,
    GraphVerifyError,
    ParseError,
    PockEngineError,
    SchemeError,
    ShapeError,
    UnsupportedOpError,
)
from pockengine.ir.parser import parse_graph
from pockengine.ir.registry import (
    COMMUTATIVE,
    EFFECTFUL,
    ELEMENTWISE,
    GRAD_PREFIX,
    Fact,
    OpDef,
    Sample,
    VJPContext,
    all_ops,
    defop,
    get_op,
    grad_source,
    has_op,
    register,
)
from pockengine.ir.types import (
    Attrs,
    DType,
    Graph,
    Node,
    Phase,
    Role,
    TensorType,
    Value,
    print_graph,
    print_node,
)
from pockengine.ir.verify import verify

__all__ = [
    "COMMUTATIVE",
    "EFFECTFUL",
    "ELEMENTWISE",
    "GRAD_PREFIX",
    "Attrs",
    "CompileError",
    "DType",
    "Fact",
    "Graph",
    "GraphBuilder",
    "GraphVerifyError",
    "Node",
    "OpDef",
    "ParseError",
    "Phase",
    "PockEngineError",
    "Role",
    "Sample",
    "SchemeError",
    "ShapeError",
    "TensorType",
    "UnsupportedOpError",
    "VJPContext",
    "Value",
    "all_ops",
    "defop",
    "get_op",
    "grad_source",
    "has_op",
    "parse_graph",
    "print_graph",
    "print_node",
    "register",
    "verify",
]
