"""Source generation for the torch backend: a graph becomes one straight-line Python function.

Each node becomes one line of source (its statements joined by ``;``, the printed IR node
as a comment), so line ``k`` of the body is node ``k`` and a traceback names the node.
The kernel tables (``kernels*``) write the statements; this
module decides everything around them:

- names: every value is a local ``v<k>``; graph inputs are the function's parameters;
- liveness: a value is deleted (``del``) on the line of its last read (``plan.last_reads``),
  results nobody reads on the line that makes them, so peak memory follows the graph's
  liveness;
- aliasing: view ops (``Fact.VIEW``: reshape, transpose, slice, ...) may share memory
  with a param,
  buffer or state tensor that a later effectful node writes in place; such a view that
  is still live at the write is copied first, and results that alias stored tensors are
  copied before they are returned, so in-place updates never change a value the IR
  considers immutable;
- saved values: a node can hand a by-product to a later kernel (max pooling indices,
  batch norm's 1/std, a weight gradient computed with the input gradient) through a
  hidden local, when the table says how to pair them (``PairFinder``);
- absorption: a node's kernel may compute the results of some later nodes
  (``links.Absorber``: batch norm its running statistics, a gated assign the run of them
  after it); their lines then emit nothing but the deaths they cause;
- constants: kernels may bind compile-time tensors as globals (``k<n>``), and a 0-d
  ``full`` input can be written as a Python literal where an ATen overload takes a Scalar;
- in-place reuse: where ``plan.inplace.reusable_inputs`` allows it (and the memory plan
  counts it), an elementwise kernel writes its result over a dying input (``Emit.into``,
  passed as ``out=``): the chains of a layer (batch norm, relu6, residual add; the
  backward's gradient sums) run in one buffer instead of allocating one per op;
- workspace: given a ``heap.Workspace`` and its buffer, a node result with a slot
  there may be written into it (``Emit.dest``, passed as ``out=``, or copied there at once
  by ``kernels.to_slot``): a view of the buffer at the slot's offset, bound as a
  global; a kernel that cannot ignores it and allocates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pockengine.backends.torch.links import (
    Absorbed,
    Absorber,
    GraphIndex,
    PairFinder,
    absorptions,
    find_pairs,
)
from pockengine.ir import DType, Fact, Graph, Node, Role, Value, get_op, print_node
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import last_reads

__all__ = [
    "Absorbed",
    "Absorber",
    "Emit",
    "Emitter",
    "GeneratedSource",
    "GraphIndex",
    "PairFinder",
    "generate_source",
]

# Fact.VIEW: ops whose result, as this backend's kernels compute it, may share memory with
# their first input (stop_gradient, cast to the same dtype and sum_to over no axis return
# it, or a view of it). Fact.CONSTANT: ops whose kernels bind compile-time constants
# (globals that must never be handed out or written).
_STORED = (Role.PARAM, Role.BUFFER, Role.STATE, Role.CONST)
_LITERAL_DTYPES = (DType.F32, DType.F64, DType.I64)
# the dtypes a workspace slot can hold (heap.plan_workspace gives float results only)
_SLOT_DTYPES = {DType.F16: torch.float16, DType.BF16: torch.bfloat16,
                DType.F32: torch.float32, DType.F64: torch.float64}  # fmt: skip


@dataclass
class Emit:
    """What a kernel sees of one node: its input expressions and result names, and helpers."""

    node: Node
    ins: tuple[str, ...]  # an expression per input: a local or a constant's global
    outs: tuple[str, ...]  # a local per result
    used: tuple[bool, ...]  # whether each result is read later or returned
    saved: str | None  # the hidden local shared with a paired node, if any
    partner: Node | None  # that node: the first reader of a maker's, the maker of a reader's
    reuse: int | None  # the input whose buffer the result may overwrite (plan.inplace)
    _gen: _Generator
    absorbed: Absorbed | None = None  # the later nodes this kernel computes too
    temps: list[str] = field(default_factory=list)  # locals deleted at the end of the line

    @property
    def out(self) -> str:
        (name,) = self.outs
        return name

    @property
    def into(self) -> str | None:
        """The local whose buffer the result may overwrite (an ``out=`` argument), or None."""
        return None if self.reuse is None else self.ins[self.reuse]

    @property
    def device(self) -> torch.device:
        return self._gen.device

    def name(self, value: Value) -> str:
        """The local of a value an absorbing kernel binds or reads (``Absorbed``)."""
        return self._gen.locals[value.name]

    def shares_saved(self, node: Node) -> bool:
        """Whether ``node`` reads this node's hidden local (a pair, ``PairFinder``)."""
        hidden = self._gen.pairs.hidden.get(self._gen.index.at(node))
        return self.saved is not None and hidden == self.saved

    def attr(self, key: str) -> Any:
        return self.node.attrs[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.node.attrs.get(key, default)

    def dtype(self, dtype: DType | str) -> str:
        """The global naming a torch dtype."""
        return f"dt_{DType(dtype)}"

    def dest(self, shape: tuple[int, ...] | None = None, result: int = 0) -> str | None:
        """A global viewing the workspace slot of result ``result`` with ``shape`` (default:
        the result's), for an ``out=`` argument, or None when it has no slot. Only results of
        an op in the workspace's op set get one (``TorchBackend(workspace=True)``)."""
        return self._gen.slot(self.node.outputs[result], shape)

    def tmp(self) -> str:
        """A fresh local, deleted at the end of this node's line."""
        name = self._gen.fresh("t")
        self.temps.append(name)
        return name

    @property
    def graph(self) -> Graph:
        return self._gen.graph

    def local(self, value: Value) -> str | None:
        """The local holding ``value`` here, if it is made already and not yet deleted."""
        name = self._gen.locals.get(value.name)
        if name is None or value.name in self._gen.input_set:
            return name  # graph inputs are never deleted
        return name if self._gen.last.get(value.name, -1) >= self._gen.line_index else None

    @property
    def index(self) -> GraphIndex:
        """The graph's producers, readers and positions (as pair finders see them)."""
        return self._gen.index

    def readers(self, i: int = 0) -> list[Node]:
        """The nodes reading result ``i``."""
        return self._gen.index.users.get(self.node.outputs[i].name, [])

    def const(self, tensor: torch.Tensor) -> str:
        """Bind a compile-time tensor (already on the device) as a global; its name."""
        return self._gen.constant(tensor)

    def shared_const(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> str:
        """A constant made once per graph for ``key`` and shared by the nodes asking for it."""
        name = self._gen.shared.get(key)
        if name is None:
            name = self._gen.shared[key] = self._gen.constant(make())
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
    """The state of one generation: names, liveness, aliases and the constants bound."""

    def __init__(
        self,
        graph: Graph,
        device: torch.device,
        finders: Mapping[str, PairFinder],
        reuse: Mapping[int, int],
        workspace: tuple[torch.Tensor, Mapping[str, int]] | None = None,
        absorbers: Mapping[str, Absorber] | None = None,
    ) -> None:
        absorbers = absorbers or {}
        self.graph = graph
        self.arena: torch.Tensor | None = None if workspace is None else workspace[0]
        self.slots: Mapping[str, int] = {} if workspace is None else workspace[1]
        self.device = device
        made_at = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
        position = {id(node): i for i, node in enumerate(graph.nodes)}
        self.index = GraphIndex(graph.producers(), graph.users(), made_at, position)
        self.locals = {v.name: f"v{k}" for k, v in enumerate(graph.inputs)}
        self.constants: dict[str, torch.Tensor] = {}
        self.shared: dict[tuple[Any, ...], str] = {}
        self.inputs = tuple(v.name for v in graph.inputs)
        self.input_set = frozenset(self.inputs)
        self.outputs = {v.name for v in graph.outputs}
        self.last = last_reads(graph)
        self.pairs = find_pairs(graph, self.index, finders)
        self.absorbed = absorptions(graph, self.index, absorbers)
        # absorbed node -> its absorber's index; the absorbed results left unmade
        self.absorber = {j: i for i, a in self.absorbed.items() for j in a.nodes}
        self.unmade = {
            v.name
            for i, a in self.absorbed.items()
            for j in a.nodes
            for v in graph.nodes[j].outputs
            if v not in a.binds
        }
        self.reuse = reuse
        # value -> the stored tensors (or "<constant>") it may share memory with
        self.aliases = {v.name: frozenset({v.name}) for v in graph.inputs if v.role in _STORED}
        self._counter = 0
        self.line_index = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def constant(self, tensor: torch.Tensor) -> str:
        name = f"k{len(self.constants)}"
        self.constants[name] = tensor
        return name

    def slot(self, out: Value, shape: tuple[int, ...] | None) -> str | None:
        """The global viewing ``out``'s workspace slot with ``shape``, if it has one."""
        offset = self.slots.get(out.name)
        if offset is None or self.arena is None:
            return None
        shape = out.shape if shape is None else shape
        key = ("slot", out.name, shape)
        if key not in self.shared:
            flat = self.arena[offset : offset + out.type.nbytes].view(_SLOT_DTYPES[out.dtype])
            self.shared[key] = self.constant(flat.view(shape))
        return self.shared[key]

    def line(self, i: int, node: Node, kernel: Emitter, after: str | None = None) -> str:
        """Node ``i`` as one line: copies its writes need, its kernel, the deaths it causes,
        then ``after``."""
        self.line_index = i
        absorbed = self.absorbed.get(i)
        later = [self.graph.nodes[j] for j in absorbed.nodes] if absorbed else []
        stmts = [s for n in (node, *later) for s in self._copies_before_write(i, n)]
        for v in (*node.outputs, *(absorbed.binds if absorbed else ())):
            self.locals.setdefault(v.name, f"v{len(self.locals)}")
        e = Emit(
            node,
            tuple(self.locals[v.name] for v in node.inputs),
            tuple(self.locals[v.name] for v in node.outputs),
            tuple(self._used(i, v) for v in node.outputs),
            self.pairs.hidden.get(i),
            self.pairs.partner.get(i),
            self.reuse.get(i),
            self,
            absorbed,
        )
        if i not in self.absorber:
            stmts += kernel(e)
        self._track_aliases(node)
        dying = {v.name for v in (*node.inputs, *node.outputs) if self.last[v.name] == i}
        dying -= self.unmade
        dead = [self.locals[n] for n in sorted(dying - self.outputs - self.input_set)]
        dead += [h for h, at in self.pairs.last.items() if at == i]
        dead += e.temps
        if dead:
            stmts.append(f"del {', '.join(dict.fromkeys(dead))}")
        if after is not None:
            stmts.append(after)
        # the printed node as a comment, on this one line whatever its source string holds
        comment = " ".join(print_node(node).splitlines()).replace("\0", "")
        return f"    {'; '.join(stmts) or 'pass'}  # {comment}"

    def _used(self, i: int, value: Value) -> bool:
        """Whether a result of node ``i`` is returned or read by a node it does not absorb."""
        if value.name in self.outputs:
            return True
        absorbed = self.absorbed.get(i)
        if absorbed is None:
            return self.last[value.name] > i
        inside = set(absorbed.nodes)
        return any(self.index.at(r) not in inside for r in self.index.users.get(value.name, []))

    def _copies_before_write(self, i: int, node: Node) -> list[str]:
        """Copy the live values that share memory with what ``node`` is about to write."""
        opdef = get_op(node.op)
        if not opdef.effectful:
            return []
        written = {node.inputs[j].name for j in opdef.mutates}
        stmts = []
        for name, shares in list(self.aliases.items()):
            if name in written or not shares & written or name not in self.locals:
                continue
            if self.last.get(name, -1) >= i or name in self.outputs:
                local = self.locals[name]
                stmts.append(f"{local} = {local}.clone()")
                self.aliases[name] = frozenset()
        return stmts

    def _track_aliases(self, node: Node) -> None:
        opdef = get_op(node.op)
        if opdef.has(Fact.CONSTANT):
            self.aliases[node.outputs[0].name] = frozenset({"<constant>"})
        elif opdef.has(Fact.VIEW) and node.outputs:
            shares = self.aliases.get(node.inputs[0].name, frozenset())
            if shares:
                self.aliases[node.outputs[0].name] = shares

    def returned(self, name: str) -> str:
        """A result sharing memory with a stored tensor or a constant is returned as a copy."""
        local = self.locals[name]
        return f"{local}.clone()" if self.aliases.get(name) else local


def generate_source(
    graph: Graph,
    kernels: Mapping[str, Emitter],
    finders: Mapping[str, PairFinder],
    device: torch.device,
    reuse: Mapping[int, int] | None = None,
    after: Mapping[int, str] | None = None,
    workspace: tuple[torch.Tensor, Mapping[str, int]] | None = None,
    absorbers: Mapping[str, Absorber] | None = None,
) -> GeneratedSource:
    """The step function's source; its globals are the kernels' and the constants.
    ``reuse``: node index -> the input whose buffer its elementwise result overwrites
    (default: all that ``plan.inplace.reusable_inputs`` allows; ``{}``: none).
    ``after``: node index -> a statement run once that node's line is done (its deaths
    included), on the same line. ``workspace``: a uint8 buffer and value name -> the byte
    offset of that result there (``heap.plan_workspace``; ``Emit.dest``). ``absorbers``:
    op -> who finds the later nodes its kernel computes too (``links.Absorber``)."""
    reuse = reusable_inputs(graph) if reuse is None else reuse
    gen = _Generator(graph, device, finders, reuse, workspace, absorbers)
    function = "step_" + "".join(c if c.isalnum() else "_" for c in graph.name)
    lines = [f"def {function}({', '.join(gen.locals[n] for n in gen.inputs)}):"]
    lines += [
        gen.line(i, node, kernels[node.op], (after or {}).get(i))
        for i, node in enumerate(graph.nodes)
    ]
    results = "".join(f"{gen.returned(v.name)}, " for v in graph.outputs)
    lines.append(f"    return ({results})")
    return GeneratedSource("\n".join(lines) + "\n", function, gen.constants, 2)
