"""Autodiff on the graph: what ``append_backward`` emits, straight after it runs (before any
pass cleans up)."""

from __future__ import annotations

import numpy as np

import pockengine.ops  # noqa: F401
from pockengine.autodiff import append_backward, depends_on
from pockengine.ir import Graph, GraphBuilder, parse_graph, verify
from pockengine.passes import eliminate_dead_code
from tests.graphgen import feeds_for, run_graph

# h depends on w; %s = stop_gradient(%t) is a copy of tanh(h) that no cotangent crosses,
# and %u, %v, %c2 are computed from it (the stopped path): %v also reads param c, which
# reaches the loss only through that path, so c gets no gradient.
STOPPED = """
graph f(x: f32[4,3] input, w: f32[3,3] param, c: f32[3] param) {
  %h: f32[4,3] = matmul(x, w)
  %t: f32[4,3] = tanh(%h)
  %s: f32[4,3] = stop_gradient(%t)
  %u: f32[4,3] = mul(%s, %s)
  %c2: f32[3] = stop_gradient(c)
  %v: f32[4,3] = add(%u, %c2)
  %d: f32[4,3] = sub(%t, %v)
  %e: f32[4,3] = mul(%d, %d)
  %loss: f32[] = sum(%e, axes=None, keepdims=False)
  return %loss
}
"""

# The same loss with the stopped values fed in as data.
FED = """
graph f(x: f32[4,3] input, w: f32[3,3] param, v: f32[4,3] input) {
  %h: f32[4,3] = matmul(x, w)
  %t: f32[4,3] = tanh(%h)
  %d: f32[4,3] = sub(%t, v)
  %e: f32[4,3] = mul(%d, %d)
  %loss: f32[] = sum(%e, axes=None, keepdims=False)
  return %loss
}
"""


def _with_backward(forward: Graph) -> tuple[Graph, int, dict[str, str]]:
    """(forward + backward as autodiff emits it, the number of forward nodes, param name ->
    its gradient's name)."""
    b = GraphBuilder("gradients")
    for v in forward.inputs:
        b.add_input(v)
    for node in forward.nodes:
        b.append(node)
    grads = append_backward(b, forward.nodes, forward.outputs[0], forward.trainable_params)
    graph = verify(b.build([forward.outputs[0], *grads.values()]))
    return graph, len(forward.nodes), {name: g.name for name, g in grads.items()}


def test_stop_gradient_cuts_the_dependence_on_params() -> None:
    forward = verify(parse_graph(STOPPED))
    active = depends_on(forward.nodes, forward.trainable_params)
    assert {"h", "t", "d", "e", "loss"} <= active
    assert not {"s", "u", "c2", "v"} & active


def test_autodiff_emits_nothing_on_the_stopped_path() -> None:
    forward = verify(parse_graph(STOPPED))
    graph, n_forward, grads = _with_backward(forward)
    backward = graph.nodes[n_forward:]
    stopped = {"s", "u", "c2", "v"}
    assert backward
    for node in backward:
        assert not stopped & {v.name for v in node.inputs}, node
    assert set(grads) == {"w"}  # c reaches the loss only through stop_gradient
    assert eliminate_dead_code(graph) is graph  # nothing emitted for DCE to remove

    fed, n_fed, _ = _with_backward(verify(parse_graph(FED)))
    assert [n.op for n in backward] == [n.op for n in fed.nodes[n_fed:]]
    feeds = feeds_for(graph)
    t = np.tanh(feeds["x"] @ feeds["w"])
    fed_feeds = {"x": feeds["x"], "w": feeds["w"], "v": (t * t + feeds["c"]).astype(np.float32)}
    (loss, gw), _ = run_graph(graph, feeds)
    (fed_loss, fed_gw), _ = run_graph(fed, fed_feeds)
    np.testing.assert_allclose(loss, fed_loss, rtol=1e-5)
    np.testing.assert_allclose(gw, fed_gw, rtol=1e-5)
