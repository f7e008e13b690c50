"""Graphs for tests of passes and plans: random training graphs, compiled zoo steps.

A random graph reads a few batch inputs, two trained params, a frozen param and a
const; it applies random elementwise, matmul, reduction and shape ops, constants, repeats
of earlier nodes (for CSE), identities (for folding) and dead nodes (for DCE), and
ends with an SGD update of each trained param by some value of the param's type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

import pockengine as pe
from pockengine import zoo
from pockengine.backends.numpy.backend import NumpyExecutable
from pockengine.ir import DType, Graph, GraphBuilder, Role, ShapeError, TensorType, Value

__all__ = ["Array", "assert_same_results", "feeds_for", "random_graphs", "run_graph", "zoo_step"]

Array = np.ndarray[Any, Any]
F32 = DType.F32
_SHAPES = ((), (4,), (1, 4), (3, 4), (4, 4), (4, 3), (12,), (3, 1))
_UNARY = ("neg", "tanh", "relu", "sigmoid", "abs")
_BINARY = ("add", "mul", "sub", "maximum")
_CONSTANTS = (0.0, 1.0, 2.0, -0.5, -0.0)


def _pick(draw: st.DrawFn, pool: list[Value]) -> Value:
    return pool[draw(st.integers(0, len(pool) - 1))]


def _op(draw: st.DrawFn, b: GraphBuilder, pool: list[Value]) -> Value | None:
    """One random node (or None when the drawn operands do not fit the op)."""
    kind = draw(st.sampled_from(["unary", "binary", "binary", "const", "matmul", "sum", "shape"]))
    x, y = _pick(draw, pool), _pick(draw, pool)
    if kind == "unary":
        return b.call(draw(st.sampled_from(_UNARY)), x)
    if kind == "binary":
        return b.call(draw(st.sampled_from(_BINARY)), x, y)
    if kind == "const":
        shape = draw(st.sampled_from(((), (), x.shape)))
        return b.call("full", shape=shape, value=draw(st.sampled_from(_CONSTANTS)), dtype="f32")
    if kind == "matmul":
        return b.call("matmul", x, y)
    if kind == "sum":
        axes = draw(st.sampled_from([None, (0,), (-1,)])) if x.shape else None
        return b.call("sum", x, axes=axes, keepdims=draw(st.booleans()))
    op = draw(st.sampled_from(["reshape", "transpose", "broadcast_to", "sum_to"]))
    if op == "transpose":
        return b.call("transpose", x, perm=draw(st.sampled_from([(1, 0), (0, 1)])))
    return b.call(op, x, shape=draw(st.sampled_from(_SHAPES)))


@st.composite
def random_graphs(draw: st.DrawFn, max_nodes: int = 24) -> Graph:
    """A verified random training graph (see the module docstring)."""
    b = GraphBuilder("random")
    pool = [
        b.input("x", TensorType((3, 4), F32)),
        b.input("y", TensorType((4,), F32)),
        b.input("c", TensorType((4, 4), F32), Role.CONST),
        b.input("f", TensorType((4, 3), F32), Role.PARAM),
    ]
    params = [
        b.input("w", TensorType((4, 4), F32), Role.PARAM, trainable=True),
        b.input("v", TensorType((3, 4), F32), Role.PARAM, trainable=True),
    ]
    pool += params
    lr = b.input("lr", TensorType((), F32), Role.STATE)
    made: list[Value] = []
    for _ in range(draw(st.integers(1, max_nodes))):
        out: Value | None
        try:
            if made and draw(st.integers(0, 5)) == 0:  # repeat an earlier node
                node = b.nodes[draw(st.integers(0, len(b.nodes) - 1))]
                attrs: dict[str, Any] = dict(node.attrs)
                out = b.call(node.op, *node.inputs, **attrs)
            else:
                out = _op(draw, b, pool)
        except ShapeError:
            continue
        if out is not None:
            pool.append(out)
            made.append(out)
    for p in params:
        grads = [v for v in made if v.type == p.type]
        update = draw(st.booleans())
        if grads and update:
            b.effect("sgd_update", p, _pick(draw, grads), lr, weight_decay=0.0)
    written = {n.inputs[0].name for n in b.nodes if n.op == "sgd_update"}
    readable = [v for v in pool if v.name not in written]
    outputs = draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3, unique=True))
    return b.build(outputs)


def feeds_for(graph: Graph, seed: int = 0) -> dict[str, Array]:
    """Random values for every input of ``graph`` (a learning rate of 0.1)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        dtype = v.dtype.to_numpy()
        if v.dtype.is_float:
            value = np.asarray(0.1) if v.shape == () else rng.standard_normal(v.shape)
            feeds[v.name] = value.astype(dtype)
        else:
            feeds[v.name] = np.zeros(v.shape, dtype)
    return {k: np.asarray(a) for k, a in feeds.items()}


def run_graph(graph: Graph, feeds: dict[str, Array]) -> tuple[list[Array], dict[str, Array]]:
    """The graph's outputs and the final values of its written inputs, on a copy of feeds."""
    store = {k: v.copy() for k, v in feeds.items()}
    outs = NumpyExecutable(graph).run(store)
    writable = (Role.PARAM, Role.BUFFER, Role.STATE)
    return outs, {v.name: store[v.name] for v in graph.inputs if v.role in writable}


def assert_same_results(
    before: Graph,
    after: Graph,
    feeds: dict[str, Array],
    check: Callable[[Array, Array], None] = np.testing.assert_array_equal,
) -> None:
    """Equal outputs and equal written values, before and after a rewrite."""
    with np.errstate(all="ignore"):
        outs0, state0 = run_graph(before, feeds)
        outs1, state1 = run_graph(after, feeds)
    assert len(outs0) == len(outs1)
    for a, c in zip(outs0, outs1, strict=True):
        assert a.shape == c.shape and a.dtype == c.dtype
        check(a, c)
    for name, value in state0.items():
        check(value, state1[name])


@functools.cache
def zoo_step(name: str, optimizer: str) -> pe.TrainStep:
    """A zoo workload compiled with an optimizer (cached: compiling takes seconds)."""
    factories: dict[str, Callable[[], zoo.Workload]] = {
        "mlp": zoo.mlp,
        "cnn": zoo.small_cnn,
        "bert": zoo.bert_classifier,
        "mbv2": lambda: zoo.mobilenet_v2(width=0.35, batch=4, size=64),
    }
    w = factories[name]()
    opt = {
        "sgd": pe.optim.SGD(lr=0.1),
        "momentum": pe.optim.SGD(lr=0.1, momentum=0.9),
        "adamw": pe.optim.AdamW(),
    }[optimizer]
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt)
