"""Rematerialisation: recompute cheap activations in the backward pass instead of saving them.

A forward value ``z`` that the backward reads is saved: it stays alive from the forward
pass to its first backward reader, and all of them are alive together at the start of
the backward pass, the step's memory peak. When ``z`` can be recomputed at its first
backward reader from values that are alive there anyway, by a few elementwise kernels,
this pass inserts that recomputation just before the reader and points every backward
reader at the copy; ``z`` itself then dies after its last forward reader.

Recomputable: ops with ``Fact.CHEAP`` (elementwise forward ops: activations, arithmetic,
clamps; views), and batch norm's and layer norm's ``y``, from the norm's input, which its
backward keeps anyway (a LoRA adapter's input is a layer norm's output: its weight
gradient reads it, so it was saved beside the layer norm's input),
whose inputs are available at the reader or recomputable in turn (up to ``MAX_DEPTH`` ops
deep). A recomputation repeats the original node exactly, statistics included for batch
norm, so every backend computes the same bits again (an eval-mode formula from the saved
statistics would differ in the last bit and could flip a ReLU6 mask at 0 or 6).
Available: a value whose last reader is at or after the insertion point, a compile-time
constant, a param, buffer or const that no effect writes before it, or a forward value
computed from those alone of at most ``KEEP_BYTES`` and a ``KEEP_RATIO``-th of the value
recomputed, kept alive for the chain (a
BatchNorm on running statistics is ``conv * s + h`` with ``s`` and ``h`` per-channel
values made from its params; keeping them, its output is recomputed from the conv output
its scale's gradient saves anyway). And, for ``rematerialize`` only, a forward value
at most a ``NARROW_RATIO``-th the size of the value recomputed (all such values of the
chain together, and at least ``NARROW_MIN_SAVING`` bytes smaller): grouped-query
attention's keys and values are saved expanded to every query head; keeping the narrow
ones instead, the expand (a copy) is repeated at the
attention's backward, and (g - 1) / g of those bytes are not saved (SmolLM2's LoRA step
saves 341 MiB instead of 387).

The typical case is a CNN's conv -> batch norm -> ReLU6: autodiff saves the conv output
for the batch norm backward and the ReLU6 output for its own backward (and the next
convolution's weight gradient). The ReLU6 output is now recomputed from the conv output,
one batch-norm pass and one clamp, so a block keeps one activation per layer instead of
two. In a gated MLP (LLaMA's ``silu(gate) * up``), ``sigmoid(gate)`` and ``silu(gate)`` are
recomputed from ``gate``.

``recompute`` is the machinery, with the rule of what may be repeated and how deep as
arguments: ``rematerialize`` is ``recompute`` with the cheap rule above, and
``passes.remat_budget`` uses it with any pure node, for the values it chooses.

Needs: a verified training graph whose backward nodes have ``Phase.BACKWARD`` and whose
effects (updates) come after the backward pass (run before ``reorder_updates``).
Guarantees: the same values, bit for bit, for every output and effect (deterministic
kernels); recomputed nodes have ``Phase.BACKWARD`` (and ``GRAD_PREFIX`` + the original
node's source), so cost and the report count them as backward work.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from pockengine.ir import GRAD_PREFIX, Fact, Graph, Node, Phase, Role, Value, get_op
from pockengine.ir.rewrite import FreshNames
from pockengine.plan.liveness import last_reads

__all__ = [
    "KEEP_BYTES",
    "KEEP_RATIO",
    "MAX_DEPTH",
    "NARROW_MIN_SAVING",
    "NARROW_RATIO",
    "Recomputable",
    "recompute",
    "rematerialize",
]

MAX_DEPTH = 3  # ops in one recomputed chain
KEEP_BYTES = 64 << 10  # a forward value this small may be kept alive for a chain ...
KEEP_RATIO = 16  # ... when the value the chain recomputes is this many times larger
NARROW_RATIO = 2  # forward values kept for a chain: at most this share of what it makes,
NARROW_MIN_SAVING = 64 << 10  # ... and at least this many bytes fewer (no churn for masks)
_RECOMPUTED = re.compile(r"_re[0-9]+$")  # a copy's name (``_State.fresh``)
_STORED = (Role.PARAM, Role.BUFFER, Role.CONST, Role.STATE)

# May the value (an output of the node) be recomputed by repeating the node?
Recomputable = Callable[[Node, Value], bool]


@dataclass
class _State:
    graph: Graph
    producers: dict[str, Node]
    last: dict[str, int]  # value -> index of its last reader (len(nodes) for outputs)
    written: dict[str, int]  # stored value -> index of the first effect writing it
    names: FreshNames  # the graph's value names and the copies' names
    recomputable: Recomputable
    from_params: set[str]  # forward values computed from stored values alone
    dropped: set[str] = field(default_factory=set)  # never kept: recomputed if read
    target_bytes: int = 0  # of the value whose chain is being planned
    inserted: dict[int, list[Node]] = field(default_factory=dict)  # before node i
    # value -> its recomputed copy and the node it is made before
    copies: dict[str, tuple[Value, int]] = field(default_factory=dict)
    planned: dict[str, Value | None] = field(default_factory=dict)  # in the chain being planned
    # May a saved value whose own turn is still to come be recomputed inside a chain
    # rather than read (None: never; see ``_saved_only``)?
    prefer: Recomputable | None = None
    pending: set[str] = field(default_factory=set)  # candidates not yet tried
    kept: dict[str, int] = field(default_factory=dict)  # narrow values the chain keeps: bytes
    narrow: bool = False  # may a chain keep narrower forward values alive (``_narrower``)?
    keep: frozenset[str] = frozenset()  # forward values a chain may keep alive and read

    def fresh(self, base: str) -> str:
        return self.names.fresh(f"{base}_re")


def _backward(node: Node) -> bool:
    return node.phase is Phase.BACKWARD


def _available(s: _State, v: Value, at: int) -> bool:
    made = s.producers.get(v.name)
    if made is None and v.role in _STORED:
        return s.written.get(v.name, len(s.graph.nodes)) > at
    if made is not None and get_op(made.op).has(Fact.CONSTANT):
        return True
    if s.last.get(v.name, -1) >= at:
        return True
    if v.name in s.keep and v.name not in s.dropped:
        return True
    # A small value made from params alone (a per-channel scale or shift) is kept alive
    # for the chain (its reads at ``at`` extend its life once the chain is committed): it
    # costs its few bytes, where the activation the chain recomputes would be saved whole.
    small = v.type.nbytes <= min(KEEP_BYTES, s.target_bytes // KEEP_RATIO)
    if v.name in s.from_params and v.name not in s.dropped and small:
        return True
    return _narrower(s, v, made)


def _narrower(s: _State, v: Value, made: Node | None) -> bool:
    """May the forward value ``v`` be kept alive for the chain because the chain makes a
    value at least ``NARROW_RATIO`` times larger from it (with the other values it keeps),
    and ``NARROW_MIN_SAVING`` bytes larger?
    Grouped-query attention's keys and values are saved *expanded* to every query head
    ([B, H, T, D] from [B, H/g, T, D], the expand materialised by a reshape); keeping the
    narrow ones and expanding them again in the backward saves (g - 1) / g of them."""
    if not s.narrow or made is None or _backward(made) or get_op(made.op).effectful:
        return False
    if v.name in s.dropped:
        return False
    kept = sum({**s.kept, v.name: v.type.nbytes}.values())  # asked twice, counted once
    if kept * NARROW_RATIO > s.target_bytes or s.target_bytes - kept < NARROW_MIN_SAVING:
        return False
    s.kept[v.name] = v.type.nbytes
    return True


_Chain = list[tuple[Node, str, Value]]  # recomputing nodes: the value recomputed, its copy


def _saved_only(s: _State, v: Value) -> bool:
    """Is ``v`` a saved value whose own recomputation is still to be tried, and cheap?
    A chain that read it would keep it saved even where its own backward readers then
    recompute it: silu(gate) = gate * sigmoid(gate), recomputed for the up-projection's
    gradient, read the saved sigmoid(gate), which silu's own gradient (a later reader)
    recomputed from gate, so sigmoid(gate) stayed saved and was made twice. Recomputed
    inside the chain instead, its copy serves its own later readers too."""
    if s.prefer is None or v.name not in s.pending:
        return False
    made = s.producers[v.name]
    return s.prefer(made, v)


def _operands_alive(s: _State, v: Value, at: int) -> bool:
    """Are all the operands of ``v``'s node available at ``at`` (one op makes it again, so
    the depth limit need not stop it)?"""
    return all(_available(s, u, at) for u in s.producers[v.name].inputs)


def _plan(s: _State, v: Value, at: int, depth: int, out: _Chain) -> Value | None:
    """``v`` recomputed at node ``at`` (its nodes appended to ``out``), or None."""
    preferred = _saved_only(s, v)
    copy = s.copies.get(v.name)
    # recomputed already, for an earlier reader (a preferred value: by an earlier chain)
    if copy is not None and copy[1] <= at and (preferred or not _available(s, v, at)):
        s.last[copy[0].name] = max(s.last[copy[0].name], at)
        return copy[0]
    if preferred and (depth > 0 or _operands_alive(s, v, at)):
        mark, planned = len(out), dict(s.planned)
        made = _plan_node(s, v, at, max(depth, 1), out)
        if made is not None:
            return made
        del out[mark:]  # not recomputable here after all: read the saved value
        s.planned = planned
        return v
    if _available(s, v, at):
        return v
    return _plan_node(s, v, at, depth, out)


def _plan_node(s: _State, v: Value, at: int, depth: int, out: _Chain) -> Value | None:
    """``v`` recomputed at node ``at`` by repeating its node, or None."""
    if v.name in s.planned:  # shared by two operands of the chain: planned once
        return s.planned[v.name]
    s.planned[v.name] = None
    made = s.producers.get(v.name)
    if made is None or depth == 0 or not s.recomputable(made, v):
        return None
    inputs = []
    for u in made.inputs:
        r = _plan(s, u, at, depth - 1, out)
        if r is None:
            return None
        inputs.append(r)
    results = tuple(Value(s.fresh(w.name), w.type) for w in made.outputs)
    source = GRAD_PREFIX + made.source
    # every result of the node is made again (attention's output and its log-sum-exp): a
    # chain needing the other one reads this copy instead of repeating the node
    for w, r in zip(made.outputs, results, strict=True):
        s.planned.setdefault(w.name, r)
    s.planned[v.name] = result = results[made.outputs.index(v)]
    node = Node(made.op, tuple(inputs), results, made.attrs, source, Phase.BACKWARD)
    out.append((node, v.name, result))
    return result


def _insertion_point(s: _State, readers: dict[str, list[int]], j: int) -> int:
    """Before backward node ``j``, or before an earlier backward node reading a backward
    value that ``j`` reads (its sibling: the input gradient of the same ``gy`` as a weight
    gradient), so that a backend computing siblings together has every operand. A
    recomputed copy is no such value: one that every layer's attention backward reads (a
    mask made once) would move each layer's recomputation to the first layer's backward,
    and keep all of them alive across the blocks between."""
    nodes = s.graph.nodes
    at = j
    for g in nodes[j].inputs:
        made = s.producers.get(g.name)
        if made is None or not _backward(made) or _RECOMPUTED.search(g.name):
            continue
        at = min(at, *(i for i in readers.get(g.name, []) if _backward(nodes[i])))
    return at


def _from_params(graph: Graph) -> set[str]:
    """The forward values whose every input is a param, buffer, const or such a value: no
    batch reaches them, so they are the same whenever they are kept."""
    made = {v.name for v in graph.inputs if v.role in _STORED}
    out: set[str] = set()
    for node in graph.nodes:
        if _backward(node) or get_op(node.op).effectful:
            continue
        if all(v.name in made or v.name in out for v in node.inputs):
            out.update(v.name for v in node.outputs)
    return out


def _cheap(node: Node, v: Value) -> bool:
    """Elementwise ops and views; a normalisation's ``y`` (batch norm's, layer norm's: its
    statistics are not read, and its input, which its own backward keeps, is the operand)."""
    if v is not node.outputs[0]:
        return False
    if node.op in _NORMS:
        return True
    return get_op(node.op).has(Fact.CHEAP) and len(node.outputs) == 1


_NORMS = frozenset({"batch_norm", "layer_norm"})


def rematerialize(graph: Graph) -> Graph:
    """Recompute the saved activations that are cheap to recompute; see the module doc."""
    return recompute(graph, _cheap, MAX_DEPTH, prefer=_cheap, narrow=True)


def recompute(
    graph: Graph,
    recomputable: Recomputable,
    depth: int,
    targets: Collection[str] | None = None,
    prefer: Recomputable | None = None,
    narrow: bool = False,
    keep: Collection[str] = (),
) -> Graph:
    """Recompute saved forward values at their first backward reader, by repeating nodes that
    ``recomputable`` admits, up to ``depth`` ops deep. ``targets=None``: every saved value
    that can be; otherwise only the values named (checkpointing: each is unavailable to the
    others' recomputations from the start, so a chain through them repeats them too).
    ``prefer``: the saved values that a chain recomputes rather than reads while their own
    turn is still to come (``_saved_only``). ``narrow``: a chain may keep a forward value
    alive that is at most a ``NARROW_RATIO``-th of what it recomputes (``_narrower``).
    ``keep``: forward values a chain may read, kept alive to the backward for it (a
    checkpointed block's input that its own backward does not read: the first layer's,
    the embedding output, where the embedding is frozen)."""
    nodes = graph.nodes
    s = _State(
        graph,
        graph.producers(),
        last_reads(graph),
        {},
        FreshNames(graph),
        recomputable,
        _from_params(graph),
        prefer=prefer,
        narrow=narrow,
        keep=frozenset(keep),
    )
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for j, v in enumerate(node.inputs):
            readers.setdefault(v.name, []).append(i)
            if j in get_op(node.op).mutates:
                s.written.setdefault(v.name, i)
    returned = {v.name for v in graph.outputs}
    renamed: dict[int, dict[str, Value]] = {}  # node index -> reads to redirect
    # Candidates in the order of their insertion points, so that a chain recomputed for an
    # earlier reader (silu(gate) for the up-projection's gradient) is there to be reused by
    # a later one (sigmoid(gate) for silu's own gradient).
    candidates = []
    for i, node in enumerate(nodes):
        if _backward(node) or get_op(node.op).effectful:
            continue
        for z in node.outputs:
            reads = readers.get(z.name, [])
            later = [j for j in reads if _backward(nodes[j])]
            if not later or z.name in returned or z.type.nbytes == 0:
                continue
            at = _insertion_point(s, readers, later[0])
            before = [j for j in reads if j not in later]
            if all(j < at for j in before) and (targets is None or z.name in targets):
                candidates.append((at, i, z, later, before))
    if targets is not None:  # dropped from the start: chains through them repeat them
        s.dropped.update(targets)
        for _, i, z, _, before in candidates:
            s.last[z.name] = max(before, default=i)
    s.pending.update(z.name for _, _, z, _, _ in candidates)
    for at, i, z, later, before in sorted(candidates, key=lambda c: (c[0], c[1])):
        s.pending.discard(z.name)
        s.last[z.name] = -1  # as if z died in the forward pass: not available at ``at``
        chain: _Chain = []
        s.planned.clear()
        s.kept.clear()
        kept = z.name in s.dropped
        s.dropped.add(z.name)
        s.target_bytes = z.type.nbytes
        copy = _plan(s, z, at, depth, chain)
        if not kept:
            s.dropped.discard(z.name)
        if copy is None or copy is z:  # (a failed chain leaves nothing behind)
            s.last[z.name] = max(later)
            continue
        s.last[z.name] = max(before, default=i)
        s.inserted.setdefault(at, []).extend(n for n, _, _ in chain)
        for j in later:
            renamed.setdefault(j, {})[z.name] = copy
        for n, original, _ in chain:  # later recomputations at or after ``at`` may reuse
            for w, made in zip(s.producers[original].outputs, n.outputs, strict=True):
                s.copies[w.name] = (made, at)
            s.last.update(dict.fromkeys((w.name for w in n.outputs), at))
            for u in n.inputs:  # read at ``at``
                s.last[u.name] = max(s.last.get(u.name, -1), at)
        s.last[copy.name] = max(s.last[copy.name], later[-1])
        s.copies[z.name] = (copy, at)
    if not s.inserted:
        return graph
    out: list[Node] = []
    for i, node in enumerate(nodes):
        out.extend(s.inserted.get(i, ()))
        mapping = renamed.get(i)
        if mapping:
            node = node.replace(inputs=tuple(mapping.get(v.name, v) for v in node.inputs))
        out.append(node)
    return graph.replace(nodes=tuple(out))
