"""Source generation for the torch backend: a graph becomes one straight-line Python function.

Each node becomes one line of source (its statements joined by ``;``, the printed IR node
as a comment), so line ``k`` of the body is node ``k`` and a traceback names the node.
The kernel table (``torch_kernels``, ``torch_kernels_nn``) writes the statements; this
module decides everything around them:

- names: every value is a local ``v<k>``; graph inputs are the function's parameters;
- liveness: a value is deleted (``del``) on the line of its last read, results nobody
  reads on the line that makes them, so peak memory follows the graph's liveness;
- aliasing: view ops (reshape, transpose, slice, ...) may share memory with a param,
  buffer or state tensor that a later effectful node writes in place; such a view that
  is still live at the write is copied first, and results that alias stored tensors are
  copied before they are returned, so in-place updates never change a value the IR
  considers immutable;
- saved values: a forward node can hand a by-product to its backward kernel (max pooling
  indices, batch norm's 1/std) through a hidden local, when the table says how to pair them;
- constants: kernels may bind compile-time tensors as globals (``k<n>``), and a 0-d
  ``full`` input can be written as a Python literal where an ATen overload takes a Scalar.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pockengine.ir import DType, Graph, Node, Role, get_op, print_node

__all__ = [
    "CONSTANT_OPS",
    "VIEW_OPS",
    "Emit",
    "Emitter",
    "GeneratedSource",
    "PairFinder",
    "generate_source",
]

# Ops whose torch result may share memory with their first input.
VIEW_OPS = frozenset(
    {"reshape", "transpose", "broadcast_to", "slice", "cast", "sum_to", "sum", "mean", "amax"}
)
# Ops whose kernels bind compile-time constants (globals that must never be handed out).
CONSTANT_OPS = frozenset({"full", "arange"})
_STORED = (Role.PARAM, Role.BUFFER, Role.STATE, Role.CONST)
_LITERAL_DTYPES = (DType.F32, DType.F64, DType.I64)


@dataclass(frozen=True, slots=True)
class GraphIndex:
    """Lookups a pair finder needs: the node making each value, the nodes reading it."""

    producers: Mapping[str, Node]
    users: Mapping[str, list[Node]]


PairFinder = Callable[[Node, GraphIndex], Node | None]


@dataclass
class Emit:
    """What a kernel sees of one node: its input expressions and result names, and helpers."""

    node: Node
    ins: tuple[str, ...]  # an expression per input: a local or a constant's global
    outs: tuple[str, ...]  # a local per result
    used: tuple[bool, ...]  # whether each result is read later or returned
    saved: str | None  # the hidden local shared with a paired node, if any
    _gen: _Generator
    pre: list[str] = field(default_factory=list)  # statements hoisted before the kernel's
    temps: list[str] = field(default_factory=list)  # locals deleted at the end of the line

    @property
    def out(self) -> str:
        (name,) = self.outs
        return name

    @property
    def device(self) -> torch.device:
        return self._gen.device

    def attr(self, key: str) -> Any:
        return self.node.attrs[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.node.attrs.get(key, default)

    def dtype(self, dtype: DType | str) -> str:
        """The global naming a torch dtype."""
        return f"dt_{DType(dtype)}"

    def tmp(self) -> str:
        """A fresh local, deleted at the end of this node's line."""
        name = self._gen.fresh("t")
        self.temps.append(name)
        return name

    def const(self, tensor: torch.Tensor) -> str:
        """Bind a compile-time tensor (already on the device) as a global; its name."""
        return self._gen.constant(tensor)

    def shared(self, key: tuple[Any, ...], expr: str) -> str:
        """A local computed once per step for ``key`` (the first node asking computes it)."""
        name = self._gen.shared.get(key)
        if name is None:
            name = self._gen.shared[key] = self._gen.fresh("s")
            self.pre.append(f"{name} = {expr}")
        return name

    def scalar(self, i: int) -> str | None:
        """Input ``i`` as a Python literal, if it is a 0-d ``full`` of a literal dtype."""
        made = self._gen.index.producers.get(self.node.inputs[i].name)
        if made is None or made.op != "full" or made.attrs["shape"] != ():
            return None
        dtype = DType(str(made.attrs["dtype"]))
        if dtype not in _LITERAL_DTYPES:
            return None
        value = made.attrs["value"]
        assert isinstance(value, int | float)
        return literal(float(value) if dtype.is_float else int(value))


def literal(value: object) -> str:
    """Python source for an attribute value (``inf``/``nan`` are bound as globals)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


Emitter = Callable[[Emit], list[str]]


@dataclass(frozen=True)
class GeneratedSource:
    source: str
    function: str  # its name
    constants: dict[str, torch.Tensor]
    first_line: int  # the source line of node 0; node k is on first_line + k


class _Generator:
    def __init__(self, graph: Graph, device: torch.device) -> None:
        self.graph = graph
        self.device = device
        users: dict[str, list[Node]] = graph.users()
        self.index = GraphIndex(graph.producers(), users)
        self.locals: dict[str, str] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.shared: dict[tuple[Any, ...], str] = {}
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def constant(self, tensor: torch.Tensor) -> str:
        name = f"k{len(self.constants)}"
        self.constants[name] = tensor
        return name


def _last_reads(graph: Graph) -> dict[str, int]:
    """The index of the last node reading each value; a result nobody reads dies where made."""
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            last[v.name] = i
        for v in node.inputs:
            last[v.name] = i
    return last


def _pairs(
    graph: Graph, index: GraphIndex, finders: Mapping[str, PairFinder]
) -> tuple[dict[int, str], dict[int, str], dict[str, int]]:
    """Hidden locals: made by node -> name, read by node -> name, and each one's last read."""
    position = {id(node): i for i, node in enumerate(graph.nodes)}
    made: dict[int, str] = {}
    read: dict[int, str] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        finder = finders.get(node.op)
        partner = finder(node, index) if finder else None
        if partner is None or position[id(partner)] >= i:
            continue
        j = position[id(partner)]
        name = made.setdefault(j, f"h{j}")
        read[i] = name
        last[name] = i
    return made, read, last


def generate_source(
    graph: Graph,
    kernels: Mapping[str, Emitter],
    finders: Mapping[str, PairFinder],
    device: torch.device,
) -> GeneratedSource:
    """The step function's source; its globals are the kernels' and the constants."""
    gen = _Generator(graph, device)
    outputs = {v.name for v in graph.outputs}
    last = _last_reads(graph)
    made, read, hidden_last = _pairs(graph, gen.index, finders)
    aliases = {v.name: frozenset({v.name}) for v in graph.inputs if v.role in _STORED}
    params = []
    for v in graph.inputs:
        gen.locals[v.name] = name = f"v{len(gen.locals)}"
        params.append(name)
    function = "step_" + "".join(c if c.isalnum() else "_" for c in graph.name)
    lines = [f"def {function}({', '.join(params)}):"]
    inputs = {v.name for v in graph.inputs}
    for i, node in enumerate(graph.nodes):
        stmts = _copies_before_write(node, i, gen, aliases, last, outputs)
        for v in node.outputs:
            gen.locals[v.name] = f"v{len(gen.locals)}"
        e = Emit(
            node,
            tuple(gen.locals[v.name] for v in node.inputs),
            tuple(gen.locals[v.name] for v in node.outputs),
            tuple(last[v.name] > i or v.name in outputs for v in node.outputs),
            made.get(i, read.get(i)),
            gen,
        )
        body = kernels[node.op](e)
        stmts += e.pre + body
        _track_aliases(node, aliases)
        dying = {v.name for v in (*node.inputs, *node.outputs) if last[v.name] == i}
        dead = [gen.locals[n] for n in sorted(dying - outputs - inputs)]
        dead += [h for h, at in hidden_last.items() if at == i]
        dead += e.temps
        if dead:
            stmts.append(f"del {', '.join(dict.fromkeys(dead))}")
        comment = print_node(node).replace("\n", " ")
        lines.append(f"    {'; '.join(stmts) or 'pass'}  # {comment}")
    results = [_returned(v.name, gen, aliases) for v in graph.outputs]
    lines.append(f"    return ({''.join(r + ', ' for r in results)})")
    return GeneratedSource("\n".join(lines) + "\n", function, gen.constants, 2)


def _copies_before_write(
    node: Node,
    i: int,
    gen: _Generator,
    aliases: dict[str, frozenset[str]],
    last: Mapping[str, int],
    outputs: set[str],
) -> list[str]:
    """Copy the live values that share memory with what ``node`` is about to write."""
    opdef = get_op(node.op)
    if not opdef.effectful:
        return []
    written = {node.inputs[j].name for j in opdef.mutates}
    stmts = []
    for name, shares in list(aliases.items()):
        if name in written or not shares & written or name not in gen.locals:
            continue
        if last.get(name, -1) >= i or name in outputs:
            local = gen.locals[name]
            stmts.append(f"{local} = {local}.clone()")
            aliases[name] = frozenset()
    return stmts


def _track_aliases(node: Node, aliases: dict[str, frozenset[str]]) -> None:
    if node.op in CONSTANT_OPS:
        aliases[node.outputs[0].name] = frozenset({"<constant>"})  # a global: never hand it out
    elif node.op in VIEW_OPS and node.outputs:
        shares = aliases.get(node.inputs[0].name, frozenset())
        if shares:
            aliases[node.outputs[0].name] = shares


def _returned(name: str, gen: _Generator, aliases: Mapping[str, frozenset[str]]) -> str:
    """A result that shares memory with a stored tensor or a constant is returned as a copy."""
    local = gen.locals[name]
    return f"{local}.clone()" if aliases.get(name) else local
