"""Invariants of a well-formed graph.

- SSA: every value name is defined once (an input or one node's result).
- Order: every node reads only inputs and results of earlier nodes.
- Types: every node's result types are what its op's shape rule gives.
- Effects: an effectful op writes only params, buffers or state; each value is
  written at most once; a frozen param is never written; and no node reads a
  value after the node that writes it (it would see the new value).
"""

from __future__ import annotations

from pockengine.ir.errors import GraphVerifyError, PockEngineError
from pockengine.ir.registry import get_op
from pockengine.ir.types import Graph, Node, Role, Value, print_node

__all__ = ["verify"]

_WRITABLE = (Role.PARAM, Role.BUFFER, Role.STATE)


def _fail(node: Node | None, msg: str) -> GraphVerifyError:
    where = f"\n  at: {print_node(node)}" if node is not None else ""
    return GraphVerifyError(msg + where)


def _check_types(node: Node) -> None:
    opdef = get_op(node.op)
    try:
        expected = opdef.infer_types([v.type for v in node.inputs], node.attrs)
    except PockEngineError as exc:
        raise _fail(node, f"shape rule rejects the node: {exc}") from None
    got = tuple(v.type for v in node.outputs)
    if got != expected:
        shown = ", ".join(str(t) for t in expected)
        raise _fail(node, f"result types differ from the shape rule ({shown})")


def _check_effect(node: Node, written: dict[str, Node]) -> None:
    for i in get_op(node.op).mutates:
        target = node.inputs[i]
        if target.role not in _WRITABLE:
            raise _fail(node, f"{target} is written but is not a param, buffer or state")
        if target.role is Role.PARAM and not target.trainable:
            raise _fail(node, f"frozen param {target} is written")
        if target.name in written:
            raise _fail(node, f"{target} is written twice")
        written[target.name] = node


def verify(graph: Graph) -> Graph:
    """Raise GraphVerifyError on the first broken invariant; return the graph."""
    defined: dict[str, Value] = {}
    for v in graph.inputs:
        if v.role is None:
            raise _fail(None, f"graph input {v.name} has no role")
        if v.name in defined:
            raise _fail(None, f"input {v.name} is declared twice")
        defined[v.name] = v
    written: dict[str, Node] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if defined.get(v.name) != v:
                what = "is read before it is defined" if v.name not in defined else "differs"
                raise _fail(node, f"{v} {what}")
            if v.name in written:
                raise _fail(node, f"{v} is read after {written[v.name].op} wrote it")
        _check_types(node)
        _check_effect(node, written)
        for v in node.outputs:
            if v.role is not None:
                raise _fail(node, f"result {v.name} has a role")
            if v.name in defined:
                raise _fail(node, f"{v} is defined twice")
            defined[v.name] = v
    for v in graph.outputs:
        if defined.get(v.name) != v:
            raise _fail(None, f"output {v} is not defined")
        if v.name in written:
            raise _fail(None, f"output {v} is read after {written[v.name].op} wrote it")
    return graph
