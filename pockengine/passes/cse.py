"""Common-subexpression elimination.

Needs: a verified graph. Guarantees: no two pure (non-effectful) nodes compute the
same op with the same attributes on the same inputs (in either order for a
commutative op); every read of a merged node's results is redirected to the first
such node, which stays where it was. Effectful nodes are never merged. Inputs are
unchanged; a graph output may now name the surviving node's result.

Two exceptions, both for results of more than ``REFILL_LIMIT`` elements: creation nodes
(no inputs), and cheap non-view nodes computed from stored values alone (``Fact.CHEAP``,
every input a param, buffer or const: a quantized weight's ``dequantize`` before each
of its readers, a tied embedding and LM head). Merging them would keep a large tensor
alive from its first use to its last, while recomputing it costs one cheap pass.

Attributes are compared by value and type (``0.0`` and ``-0.0``, ``1`` and ``1.0``
are different), so a merge never changes a result, not even the sign of a zero.
Merging keeps the first result alive until the last read of the merged ones; that is
the usual trade of CSE, and the memory plan reports its cost.
"""

from __future__ import annotations

from pockengine.ir import Attrs, Graph, Node, Role, Value, get_op
from pockengine.ir.registry import Fact
from pockengine.ir.rewrite import substitute

__all__ = ["REFILL_LIMIT", "eliminate_common_subexpressions", "node_key"]

REFILL_LIMIT = 64  # elements; larger creation nodes are refilled rather than shared
_STORED = (Role.PARAM, Role.BUFFER, Role.CONST)

_Key = tuple[str, tuple[str, ...], str]


def _attr_key(attrs: Attrs) -> str:
    """A canonical text of the attributes that tells 0.0 from -0.0 and 1 from 1.0."""
    return repr(sorted((k, _typed(v)) for k, v in attrs.items()))


def _typed(value: object) -> object:
    if isinstance(value, tuple):
        return tuple(_typed(v) for v in value)
    return (type(value).__name__, repr(value))


def _key(node: Node) -> _Key | None:
    """What makes two nodes interchangeable, or None for a node never merged."""
    opdef = get_op(node.op)
    if opdef.effectful:
        return None
    if sum(v.type.numel for v in node.outputs) > REFILL_LIMIT and (
        not node.inputs or _recomputed_from_stored(node)
    ):
        return None
    return node_key(node)


def node_key(node: Node) -> _Key:
    """What makes two pure nodes compute the same results: the op, the input names (sorted
    for a commutative op) and the attributes by value and type."""
    names = tuple(v.name for v in node.inputs)
    if get_op(node.op).has(Fact.COMMUTATIVE):
        names = tuple(sorted(names))
    return node.op, names, _attr_key(node.attrs)


def _recomputed_from_stored(node: Node) -> bool:
    opdef = get_op(node.op)
    stored = all(v.role in _STORED for v in node.inputs)
    return stored and opdef.has(Fact.CHEAP) and not opdef.has(Fact.VIEW)


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Merge repeated pure computations into their first occurrence."""
    first: dict[_Key, Node] = {}
    mapping: dict[str, Value] = {}
    kept: list[Node] = []
    for node in graph.nodes:
        (node,) = substitute((node,), mapping)
        key = _key(node)
        earlier = first.get(key) if key is not None else None
        if earlier is not None and [v.type for v in earlier.outputs] == [
            v.type for v in node.outputs
        ]:
            mapping.update(
                (new.name, old) for new, old in zip(node.outputs, earlier.outputs, strict=True)
            )
            continue
        if key is not None:
            first[key] = node
        kept.append(node)
    if not mapping:
        return graph
    outputs = tuple(mapping.get(v.name, v) for v in graph.outputs)
    return graph.replace(nodes=tuple(kept), outputs=outputs)
