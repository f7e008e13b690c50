"""IR: builder, printer/parser round trip, verify's invariants."""

from __future__ import annotations

import pytest

import pockengine.ops  # noqa: F401
from pockengine.ir import (
    DType,
    Graph,
    GraphBuilder,
    GraphVerifyError,
    Node,
    ParseError,
    Phase,
    Role,
    ShapeError,
    TensorType,
    UnsupportedOpError,
    Value,
    parse_graph,
    verify,
)

F32 = DType.F32


def _small_train_graph() -> Graph:
    b = GraphBuilder("train_step")
    x = b.input("x", TensorType((8, 4), F32))
    w = b.input("layer.0.weight", TensorType((4, 3), F32), Role.PARAM, trainable=True)
    f = b.input("frozen.w", TensorType((3, 3), F32), Role.PARAM)
    lr = b.input("optim.lr", TensorType((), F32), Role.STATE)
    h = b.call("matmul", x, w, source="layer.0")
    z = b.call("matmul", h, f, source="frozen")
    loss = b.call("sum", z, axes=None, keepdims=False)
    gw = b.call("matmul", b.call("transpose", x, perm=(1, 0)), b.call("full", shape=(8, 3),
                value=1.0, dtype="f32"))  # fmt: skip
    b.effect("sgd_update", w, gw, lr, weight_decay=0.0, source="optim layer.0.weight")
    return b.build([loss])


def test_print_parse_round_trip() -> None:
    g = verify(_small_train_graph())
    text = str(g)
    assert "layer.0.weight: f32[4,3] param," in text
    assert "frozen.w: f32[3,3] param(frozen)" in text
    assert "! sgd_update(layer.0.weight, %" in text
    back = parse_graph(text)
    assert back == g
    assert str(back) == text


def test_phases_are_set_by_the_builder_and_round_trip_through_text() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2,), F32))
    w = b.input("w", TensorType((2,), F32), Role.PARAM, trainable=True)
    lr = b.input("lr", TensorType((), F32), Role.STATE)
    y = b.call("mul", x, w, source="m")
    with b.in_phase(Phase.BACKWARD):
        g = b.call("mul", y, x, source="grad m")
        with b.in_phase(Phase.UPDATE):
            b.effect("sgd_update", w, g, lr, weight_decay=0.0)
        assert b.phase is Phase.BACKWARD  # restored on leaving the block
    s = b.call("sum", y, axes=None, keepdims=False, phase=Phase.UPDATE)
    graph = verify(b.build([s]))
    assert [n.phase for n in graph.nodes] == [Phase.FORWARD, Phase.BACKWARD, Phase.UPDATE,
                                              Phase.UPDATE]  # fmt: skip
    text = str(graph)
    assert "= mul(%mul0, x) @backward  # grad m" in text and "weight_decay=0.0) @update" in text
    assert parse_graph(text) == graph


def test_builder_checks_shapes_and_names_the_source() -> None:
    b = GraphBuilder()
    x = b.input("x", TensorType((2, 3), F32))
    with pytest.raises(ShapeError, match=r"matmul.*at block\.1"):
        b.call("matmul", x, x, source="block.1")


def test_unknown_op_is_named() -> None:
    b = GraphBuilder()
    with pytest.raises(UnsupportedOpError, match="fancy_op"):
        b.call("fancy_op")


def test_verify_rejects_use_before_definition() -> None:
    g = _small_train_graph()
    nodes = (g.nodes[1], g.nodes[0], *g.nodes[2:])
    with pytest.raises(GraphVerifyError, match="read before it is defined"):
        verify(g.replace(nodes=nodes))


def test_verify_rejects_read_after_update() -> None:
    g = _small_train_graph()
    w = g.input_named("layer.0.weight")
    late = Node("sum", (w,), (Value("late", TensorType((), F32)),), g.nodes[2].attrs)
    with pytest.raises(GraphVerifyError, match="read after sgd_update wrote it"):
        verify(g.replace(nodes=(*g.nodes, late)))


def test_verify_rejects_write_of_frozen_param() -> None:
    g = _small_train_graph()
    frozen = g.input_named("layer.0.weight").replace(trainable=False)
    inputs = tuple(frozen if v.name == frozen.name else v for v in g.inputs)
    nodes = tuple(
        n.replace(inputs=tuple(frozen if v.name == frozen.name else v for v in n.inputs))
        for n in g.nodes
    )
    with pytest.raises(GraphVerifyError, match=r"frozen param layer\.0\.weight is written"):
        verify(g.replace(inputs=inputs, nodes=nodes))


def test_verify_rejects_wrong_result_type() -> None:
    g = _small_train_graph()
    bad = g.nodes[0].replace(outputs=(Value(g.nodes[0].output.name, TensorType((8, 2), F32)),))
    with pytest.raises(GraphVerifyError, match="differ from the shape rule"):
        verify(g.replace(nodes=(bad, *g.nodes[1:])))


def test_parse_errors_are_clear() -> None:
    with pytest.raises(ParseError, match="undefined value"):
        parse_graph("graph g(x: f32[2] input,) {\n  %y: f32[2] = neg(%nope)\n  return %y\n}")
    with pytest.raises(ParseError, match="expected 'graph"):
        parse_graph("nonsense")
