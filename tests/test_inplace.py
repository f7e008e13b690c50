"""In-place reuse: which elementwise results may overwrite a dying input (``plan.inplace``),
how the memory plan counts it, and the torch backend writing them with ``out=``.

- the rules on hand-written graphs: graph inputs, constants, broadcast views, views or
  results still read later, another view of the same buffer among the inputs, shape or
  dtype changes all keep a fresh buffer; chains share one;
- the liveness and the plan: a reused input's lifetime ends before the node, and the
  result takes exactly its offset;
- every op with ``Fact.INPLACE`` on the torch backend, as a node whose inputs are the step's own
  buffers: its line writes with ``out=``/``grad_input=`` and its result matches NumPy;
- the feeds and params are never written; a whole model trains the same with and without.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch.backend import TorchBackend
from pockengine.ir import DType, GraphBuilder, Role, TensorType, all_ops, parse_graph, print_node
from pockengine.plan import inplace_ops, liveness, plan_memory, reusable_inputs

Array = np.ndarray[Any, Any]

RULES = """
graph rules(x: f32[4,4] input, w: f32[4,4] param, s: f32[4] input) {
  %a: f32[4,4] = mul(x, w)
  %b: f32[4,4] = tanh(%a)
  %r: f32[4,4] = reshape(%b, shape=(4, 4))
  %c: f32[4,4] = neg(%r)
  %d: f32[4,4] = exp(%b)
  %e: f32[4,4] = add(%c, %d)
  %t: f32[4,4] = transpose(%e, perm=(1, 0))
  %f: f32[4,4] = add(%e, %t)
  %bs: f32[4,4] = broadcast_to(s, shape=(4, 4))
  %sg: f32[4] = sigmoid(s)
  %bg: f32[4,4] = broadcast_to(%sg, shape=(4, 4))
  %g: f32[4,4] = mul(%bg, %f)
  %k: f32[] = full(shape=(), value=2.0, dtype='f32')
  %h: f32[4,4] = mul(%g, %k)
  %i: f32[4,4] = add(%bs, %h)
  %z: f32[2,4,4] = broadcast_to(%h, shape=(2, 4, 4))
  %big: f32[2,4,4] = add(%i, %z)
  %m: f32[4,4] = mul(%i, %i)
  return %m, %big
}
"""


def test_reuse_rules() -> None:
    g = parse_graph(RULES)
    at = {n.outputs[0].name: i for i, n in enumerate(g.nodes) if n.outputs}
    reuse = {g.nodes[i].outputs[0].name: g.nodes[i].inputs[k].name
             for i, k in reusable_inputs(g).items()}  # fmt: skip
    assert "a" not in reuse  # x is the caller's batch, w a param
    assert reuse["b"] == "a"  # %a dies at tanh
    assert "c" not in reuse  # %r is a view of %b, which exp reads later
    assert reuse["d"] == "b"  # the last reader of %b (and of its view %r)
    assert reuse["e"] == "c"
    assert "f" not in reuse  # %t is another view of %e's buffer: its elements would be read
    assert "sg" not in reuse  # s is a batch input
    assert reuse["g"] == "f"  # %bg is a broadcast view (one address, many elements)
    assert reuse["h"] == "g"  # %k is a compile-time constant, and 0-d
    assert "i" not in reuse  # %h is read later through the broadcast %z
    assert "big" not in reuse  # the result is larger than either input
    assert reuse["m"] == "i"  # both inputs are the same value: fine
    assert at["m"] in reusable_inputs(g)


def test_no_reuse_across_dtypes_or_for_unlisted_ops() -> None:
    g = parse_graph("""
graph g(x: f32[3] input) {
  %a: f32[3] = exp(x)
  %b: f64[3] = cast(%a, dtype='f64')
  %c: f64[3] = exp(%b)
  %d: f32[3] = exp(x)
  %e: bool[3] = gt(%d, %d)
  return %c, %e
}
""")
    reuse = reusable_inputs(g)
    assert reuse == {2: 0}  # exp of the cast (a fresh f64 buffer); gt makes bool
    assert reusable_inputs(g, frozenset()) == {}


def test_liveness_and_plan_count_the_reuse() -> None:
    n = 1024  # a chain of elementwise ops on 4 KiB values
    g = parse_graph(f"""
graph chain(x: f32[{n}] input) {{
  %a: f32[{n}] = exp(x)
  %b: f32[{n}] = tanh(%a)
  %c: f32[{n}] = neg(%b)
  %d: f32[{n}] = sigmoid(%c)
  return %d
}}
""")
    reuse = reusable_inputs(g)
    assert reuse == {1: 0, 2: 0, 3: 0}
    spans = {k: (iv.start, iv.end) for k, iv in liveness(g, reuse).intervals.items()}
    assert spans == {"x": (-1, 0), "a": (0, 0), "b": (1, 1), "c": (2, 2), "d": (3, 4)}
    # x and a meet at node 0 only; afterwards one buffer at a time
    assert plan_memory(g).peak_live_bytes == 2 * 4 * n
    assert plan_memory(g, reuse={}).liveness.live_bytes() == [8 * n] * 4
    assert plan_memory(g).liveness.live_bytes() == [8 * n, 4 * n, 4 * n, 4 * n]


def _inplace_cases() -> list[Any]:
    cases = []
    for name in sorted(inplace_ops()):
        opdef = all_ops()[name]
        assert opdef.samples is not None, name
        for i, s in enumerate(opdef.samples(np.random.default_rng(0))):
            cases.append(pytest.param(name, s, id=f"{name}-{i}"))
    return cases


@pytest.mark.parametrize(("op", "sample"), _inplace_cases())
def test_every_inplace_op_writes_over_a_dying_input(op: str, sample: Any) -> None:
    """Each input is first copied into the step's own buffer (neg twice), so the op may
    write over one; the torch line says so and the result matches NumPy in float64."""
    b = GraphBuilder(op)
    fresh = []
    for i, a in enumerate(sample.inputs):
        x = b.input(f"x{i}", TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
        fresh.append(b.call("neg", b.call("neg", x, source="t"), source="t"))
    graph = b.build([b.call(op, *fresh, source="t", **sample.attrs)])
    out = graph.outputs[0]
    expect_reuse = any(v.type == out.type for v in graph.nodes[-1].inputs)
    assert (len(graph.nodes) - 1 in reusable_inputs(graph)) == expect_reuse
    feeds = {f"x{i}": a.copy() for i, a in enumerate(sample.inputs)}
    want = NumpyBackend().compile(graph).run({}, feeds)
    backend = TorchBackend()
    exe = backend.compile(graph)
    line = exe.source.splitlines()[exe._first_line - 1 + len(graph.nodes) - 1]
    assert (("out=" in line) or ("grad_input=" in line)) == expect_reuse, line
    got = exe.run({}, {k: backend.from_numpy(v) for k, v in feeds.items()})
    np.testing.assert_allclose(backend.to_numpy(got[0]), want[0], rtol=1e-10, atol=1e-10)


def test_feeds_and_params_are_never_written() -> None:
    g = parse_graph("""
graph g(x: f32[2,3] input, w: f32[2,3] param) {
  %a: f32[2,3] = add(x, w)
  %b: f32[2,3] = mul(w, x)
  %c: f32[2,3] = add(%a, %b)
  return %c
}
""")
    backend = TorchBackend()
    exe = backend.compile(g)
    assert exe.source.count("out=") == 1  # only %c, over %a
    x, w = torch.ones(2, 3), torch.full((2, 3), 2.0)
    (c,) = exe.run({"w": w}, {"x": x})
    assert torch.equal(x, torch.ones(2, 3)) and torch.equal(w, torch.full((2, 3), 2.0))
    assert torch.equal(c, torch.full((2, 3), 5.0))


def test_a_model_trains_the_same_with_and_without_reuse() -> None:
    losses = []
    for inplace in (True, False):
        work = zoo.mobilenet_v2(width=0.35, batch=2, size=32)
        batch = work.make_batch(0)
        sgd = pe.optim.SGD(lr=0.1, momentum=0.9)
        backend = TorchBackend(inplace=inplace)
        step = pe.compile(work.model, work.loss_fn, batch, sgd, pe.schemes.bias_only(), backend)
        assert ("out=" in step._exec.source) == inplace
        losses.append([step(*batch) for _ in range(3)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_a_reusing_result_takes_exactly_its_inputs_offset() -> None:
    """The C backend runs the plan's offsets as they are: a result written over a dying
    input must start where the input does (placed apart, the two could overlap at a
    shift, and element i's write would clobber input elements not yet read)."""
    w = zoo.small_cnn()
    opt = pe.optim.SGD(lr=0.1, momentum=0.9)
    graph = pe.compile(w.model, w.loss_fn, w.make_batch(0), opt, backend="c").graph
    reuse = reusable_inputs(graph)
    plan = plan_memory(graph)
    taken = 0
    for i, k in reuse.items():
        node = graph.nodes[i]
        src, out = node.inputs[k].name, node.outputs[0].name
        if plan.liveness.intervals[src].end == i - 1:
            assert plan.offsets[src] == plan.offsets[out], print_node(node)
            taken += 1
    assert taken >= 5
    assert plan.arena_bytes >= plan.peak_live_bytes
