"""GraphBuilder: the one mutable object, and the only way to make a graph.

Every node is type-checked by its op's shape rule as it is added, so a graph
that a builder returns is well typed by construction.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pockengine.ir.errors import CompileError, ShapeError
from pockengine.ir.registry import get_op
from pockengine.ir.types import Attrs, DType, Graph, Node, Phase, Role, TensorType, Value

__all__ = ["GraphBuilder"]

_NAME_OK = re.compile(r"\w[\w.]*")


class GraphBuilder:
    """Appends typed nodes in order and hands out fresh SSA names."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self._names: set[str] = set()
        self._later: set[str] = set()  # names a rewrite will append: fresh() skips them
        self._counter = 0
        self.phase = Phase.FORWARD  # the phase of the nodes ``call`` adds without one

    @classmethod
    def rewriting(cls, graph: Graph) -> GraphBuilder:
        """A builder for a rewrite of ``graph``: its inputs added, and every result name of
        its nodes kept for ``append``, so a fresh name given to a new node never collides
        with a node of ``graph`` copied after it."""
        b = cls(graph.name)
        for v in graph.inputs:
            b.add_input(v)
        b._later = {out.name for node in graph.nodes for out in node.outputs}
        return b

    @contextmanager
    def in_phase(self, phase: Phase) -> Iterator[None]:
        """Nodes added inside the block get ``phase`` (autodiff: BACKWARD; optimizer: UPDATE)."""
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    # -- names -------------------------------------------------------------
    def fresh(self, hint: str = "t") -> str:
        """A name not used yet in this graph, derived from ``hint``."""
        base = re.sub(r"[^\w.]", "_", hint) or "t"
        if not base[0].isalpha() and base[0] != "_":
            base = "v" + base
        while True:
            name = f"{base}{self._counter}"
            self._counter += 1
            if name not in self._names and name not in self._later:
                self._names.add(name)
                return name

    def reserve(self, name: str) -> str:
        if not _NAME_OK.fullmatch(name):
            raise CompileError(f"invalid value name {name!r}")
        if name in self._names:
            raise CompileError(f"value name {name!r} is used twice")
        self._names.add(name)
        self._later.discard(name)
        return name

    # -- inputs ------------------------------------------------------------
    def input(
        self, name: str, type: TensorType, role: Role = Role.INPUT, trainable: bool = False
    ) -> Value:
        value = Value(self.reserve(name), type, role, trainable and role is Role.PARAM)
        self.inputs.append(value)
        return value

    def add_input(self, value: Value) -> Value:
        """Add an existing input value (a rewrite keeps names)."""
        self.reserve(value.name)
        self.inputs.append(value)
        return value

    # -- nodes -------------------------------------------------------------
    def call_multi(
        self,
        op: str,
        *inputs: Value,
        source: str = "",
        name: str | None = None,
        phase: Phase | None = None,
        **attrs: Any,
    ) -> tuple[Value, ...]:
        """Add ``op(*inputs, **attrs)``; returns its results (none for a pure effect)."""
        opdef = get_op(op)
        frozen = Attrs(attrs)
        try:
            types = opdef.infer_types([v.type for v in inputs], frozen)
        except ShapeError as exc:
            where = f" at {source}" if source else ""
            raise ShapeError(f"{exc}{where}") from None
        hint = name or op
        outs = tuple(Value(self.fresh(hint), t) for t in types)
        self.nodes.append(Node(op, tuple(inputs), outs, frozen, source, phase or self.phase))
        return outs

    def call(
        self,
        op: str,
        *inputs: Value,
        source: str = "",
        name: str | None = None,
        phase: Phase | None = None,
        **attrs: Any,
    ) -> Value:
        """Add a single-result op and return its result."""
        outs = self.call_multi(op, *inputs, source=source, name=name, phase=phase, **attrs)
        if len(outs) != 1:
            raise CompileError(f"{op} has {len(outs)} results; use call_multi")
        return outs[0]

    def effect(self, op: str, *inputs: Value, source: str = "", **attrs: Any) -> None:
        """Add an effectful op (an update that writes some inputs in place), in the
        builder's current phase (the optimizer's updates: ``in_phase(Phase.UPDATE)``)."""
        outs = self.call_multi(op, *inputs, source=source, **attrs)
        if outs:
            raise CompileError(f"{op} has results; effects have none")

    def scalar(
        self, value: float, dtype: DType = DType.F32, source: str = "", phase: Phase | None = None
    ) -> Value:
        """A 0-d constant; elementwise ops broadcast it."""
        return self.call(
            "full", source=source, name="c", phase=phase, shape=(), value=value, dtype=str(dtype)
        )

    def append(self, node: Node) -> Node:
        """Append a node whose result names are already chosen (rewrites, the parser)."""
        for out in node.outputs:
            self.reserve(out.name)
        self.nodes.append(node)
        return node

    def build(self, outputs: tuple[Value, ...] | list[Value]) -> Graph:
        return Graph(self.name, tuple(self.inputs), tuple(self.nodes), tuple(outputs))
