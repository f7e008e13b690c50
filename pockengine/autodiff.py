"""Reverse-mode autodiff over the IR, at compile time.

``append_backward`` walks the forward nodes in reverse, visiting only nodes
that lie between the loss and the requested values: a node is differentiated
only when one of its results has a cotangent and one of its inputs depends on
a requested value. Each op's VJP rule receives a mask of the inputs that need a
cotangent. Broadcasting is undone here, once, with ``sum_to``; cotangents of a
value read by several nodes are summed.

Frozen parameters are simply not requested: no node of theirs gets a
cotangent, and nothing of their backward exists in the graph. Ops of the
``Fact.NO_GRADIENT`` (``stop_gradient``) cut the dependence: their results depend
on nothing, so no backward node is emitted for what reads only them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pockengine.ir import (
    CompileError,
    Fact,
    GraphBuilder,
    Node,
    Phase,
    Value,
    VJPContext,
    get_op,
    grad_source,
)

__all__ = ["append_backward", "depends_on"]


def depends_on(nodes: Sequence[Node], sources: Sequence[Value]) -> set[str]:
    """Names of the float values that depend on any of ``sources`` (sources included).

    A result of a ``Fact.NO_GRADIENT`` op depends on nothing: no cotangent crosses it.
    """
    active = {v.name for v in sources}
    for node in nodes:
        opdef = get_op(node.op)
        if opdef.effectful or opdef.has(Fact.NO_GRADIENT):
            continue
        if any(v.name in active for v in node.inputs):
            active.update(v.name for v in node.outputs if v.dtype.is_float)
    return active


def _accumulate(b: GraphBuilder, cts: dict[str, Value], x: Value, g: Value, node: Node) -> None:
    if g.shape != x.shape:
        g = b.call("sum_to", g, shape=x.shape, source=grad_source(node.source))
    if g.type != x.type:
        raise CompileError(
            f"VJP of {node.op} at {node.source or '?'} gave {g.type} for input {x} of {x.type}"
        )
    old = cts.get(x.name)
    cts[x.name] = g if old is None else b.call("add", old, g, source=grad_source(node.source))


def append_backward(
    b: GraphBuilder, nodes: Sequence[Node], loss: Value, wrt: Sequence[Value]
) -> dict[str, Value]:
    """Emit into ``b`` the backward of ``nodes`` from the scalar ``loss`` to ``wrt``.

    Returns the gradient value of each requested input that the loss depends on;
    a requested value the loss does not depend on has no entry. Every node emitted has
    ``Phase.BACKWARD``.
    """
    with b.in_phase(Phase.BACKWARD):
        return _backward(b, nodes, loss, wrt)


def _backward(
    b: GraphBuilder, nodes: Sequence[Node], loss: Value, wrt: Sequence[Value]
) -> dict[str, Value]:
    if loss.shape != () or not loss.dtype.is_float:
        raise CompileError(f"the loss must be a float scalar, got {loss.type}")
    active = depends_on(nodes, wrt)
    seed = b.call("full", shape=(), value=1.0, dtype=str(loss.dtype), source=grad_source("loss"))
    cts: dict[str, Value] = {loss.name: seed}
    for node in reversed(nodes):
        out_cts = tuple(cts.get(v.name) for v in node.outputs)
        if all(ct is None for ct in out_cts):
            continue
        needs = tuple(v.name in active and v.dtype.is_float for v in node.inputs)
        if not any(needs):
            continue
        opdef = get_op(node.op)
        if opdef.vjp is None:
            raise CompileError(
                f"op {node.op} at {node.source or '?'} has no VJP, but a trained value depends "
                "on it"
            )
        grads = opdef.vjp(VJPContext(b, node, out_cts, needs))
        for x, g, need in zip(node.inputs, grads, needs, strict=True):
            if need and g is not None:
                _accumulate(b, cts, x, g, node)
    return {v.name: cts[v.name] for v in wrt if v.name in cts}
