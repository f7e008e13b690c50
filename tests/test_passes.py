"""Passes: golden before/expected listings, the invariant each promises, verify, and the
same NumPy results before and after, on hand-written, random and zoo graphs."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pockengine.ir import Graph, Role, get_op, parse_graph, verify
from pockengine.ir.registry import Fact
from pockengine.passes import (
    DEFAULT_PIPELINE,
    FORWARD_PIPELINE,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_channel_affine,
    fold_constants,
    fuse_linear_bias,
    fuse_linear_cross_entropy,
    fuse_loss_backward,
    rematerialize,
    reorder_updates,
    run_pipeline,
)
from tests.graphgen import Array, assert_same_results, feeds_for, random_graphs, zoo_step

Pass = Callable[[Graph], Graph]
PASSES: tuple[Pass, ...] = (
    fold_channel_affine,
    fuse_linear_cross_entropy,
    fold_constants,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fuse_linear_bias,
    fuse_loss_backward,
    rematerialize,
    reorder_updates,
)


def _close(a: Array, b: Array) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)


def _check_pass(p: Pass, before: str, expected: str) -> Graph:
    """The pass turns the listing ``before`` into ``expected``, verified, with equal results."""
    graph = verify(parse_graph(before))
    after = verify(p(graph))
    want = parse_graph(expected)
    assert str(after) == str(want)
    assert after == want
    assert parse_graph(str(after)) == after  # the printer and parser round-trip
    assert_same_results(graph, after, feeds_for(graph), _close)
    return after


# -- common-subexpression elimination -------------------------------------------------

CSE_BEFORE = """
graph g(x: f32[4] input, y: f32[4] input) {
  %a: f32[] = full(shape=(), value=2.0, dtype='f32')
  %b: f32[] = full(shape=(), value=2.0, dtype='f32')
  %z: f32[] = full(shape=(), value=0.0, dtype='f32')
  %nz: f32[] = full(shape=(), value=-0.0, dtype='f32')
  %big: f32[100] = full(shape=(100,), value=2.0, dtype='f32')
  %big2: f32[100] = full(shape=(100,), value=2.0, dtype='f32')
  %m1: f32[4] = mul(x, %a)
  %m2: f32[4] = mul(%b, x)
  %s1: f32[4] = sub(x, y)
  %s2: f32[4] = sub(y, x)
  %p: f32[4] = add(%m1, %m2)
  %q: f32[4] = add(%s1, %z)
  %r: f32[4] = add(%s2, %nz)
  %u: f32[] = sum(%big, axes=None, keepdims=False)
  %v: f32[] = sum(%big2, axes=None, keepdims=False)
  return %p, %q, %r, %u, %v
}
"""

CSE_EXPECTED = """
graph g(x: f32[4] input, y: f32[4] input) {
  %a: f32[] = full(shape=(), value=2.0, dtype='f32')
  %z: f32[] = full(shape=(), value=0.0, dtype='f32')
  %nz: f32[] = full(shape=(), value=-0.0, dtype='f32')
  %big: f32[100] = full(shape=(100,), value=2.0, dtype='f32')
  %big2: f32[100] = full(shape=(100,), value=2.0, dtype='f32')
  %m1: f32[4] = mul(x, %a)
  %s1: f32[4] = sub(x, y)
  %s2: f32[4] = sub(y, x)
  %p: f32[4] = add(%m1, %m1)
  %q: f32[4] = add(%s1, %z)
  %r: f32[4] = add(%s2, %nz)
  %u: f32[] = sum(%big, axes=None, keepdims=False)
  %v: f32[] = sum(%big2, axes=None, keepdims=False)
  return %p, %q, %r, %u, %v
}
"""


def test_cse_golden() -> None:
    # mul is commutative, sub is not; 0.0 and -0.0 differ; large fills are refilled
    _check_pass(eliminate_common_subexpressions, CSE_BEFORE, CSE_EXPECTED)


def _cse_keys(graph: Graph) -> list[tuple[str, tuple[str, ...], str]]:
    keys = []
    for node in graph.nodes:
        opdef = get_op(node.op)
        if opdef.effectful or (not node.inputs and node.output.type.numel > 64):
            continue
        names = [v.name for v in node.inputs]
        if opdef.has(Fact.COMMUTATIVE):
            names.sort()
        attrs = sorted((k, type(v).__name__, repr(v)) for k, v in node.attrs.items())
        keys.append((node.op, tuple(names), repr(attrs)))
    return keys


def assert_no_common_subexpressions(graph: Graph) -> None:
    keys = _cse_keys(graph)
    assert len(keys) == len(set(keys))


# -- constant folding and identities --------------------------------------------------

FOLD_BEFORE = """
graph g(x: f32[2,3] input, c: f32[2,3] const, w: f32[3,2] param, lr: f32[] state) {
  %one: f32[] = full(shape=(), value=1.0, dtype='f32')
  %two: f32[] = full(shape=(), value=2.0, dtype='f32')
  %three: f32[] = add(%one, %two)
  %big: f32[2,3] = broadcast_to(%three, shape=(2, 3))
  %r: i64[4] = arange(start=0, stop=4, step=1, dtype='i64')
  %rr: i64[2,2] = reshape(%r, shape=(2, 2))
  %rz: i64[2,2] = mul(%rr, %rr)
  %rs: i64[2] = sum(%rz, axes=(0,), keepdims=False)
  %zero: i64[2] = sub(%rs, %rs)
  %a: f32[2,3] = mul(x, %one)
  %b: f32[2,3] = add(%a, %big)
  %cc: f32[2,3] = add(c, %big)
  %t1: f32[3,2] = transpose(%b, perm=(1, 0))
  %t2: f32[2,3] = transpose(%t1, perm=(1, 0))
  %d: f32[2,3] = reshape(%t2, shape=(2, 3))
  %e: f32[2,3] = sub(%d, %cc)
  %wr: f32[6] = reshape(w, shape=(6,))
  %ws: f32[3,2] = reshape(%wr, shape=(3, 2))
  %g: f32[3,2] = transpose(%e, perm=(1, 0))
  ! sgd_update(w, %g, lr, weight_decay=0.0)
  return %e, %zero, %ws
}
"""

FOLD_EXPECTED = """
graph g(x: f32[2,3] input, c: f32[2,3] const, w: f32[3,2] param, lr: f32[] state) {
  %one: f32[] = full(shape=(), value=1.0, dtype='f32')
  %two: f32[] = full(shape=(), value=2.0, dtype='f32')
  %three: f32[] = full(shape=(), value=3.0, dtype='f32')
  %big: f32[2,3] = full(shape=(2, 3), value=3.0, dtype='f32')
  %r: i64[4] = arange(start=0, stop=4, step=1, dtype='i64')
  %rr: i64[2,2] = reshape(%r, shape=(2, 2))
  %rz: i64[2,2] = mul(%rr, %rr)
  %rs: i64[2] = sum(%rz, axes=(0,), keepdims=False)
  %zero: i64[2] = full(shape=(2,), value=0, dtype='i64')
  %b: f32[2,3] = add(x, %big)
  %cc: f32[2,3] = add(c, %big)
  %t1: f32[3,2] = transpose(%b, perm=(1, 0))
  %e: f32[2,3] = sub(%b, %cc)
  %wr: f32[6] = reshape(w, shape=(6,))
  %ws: f32[3,2] = reshape(w, shape=(3, 2))
  %g: f32[3,2] = transpose(%e, perm=(1, 0))
  ! sgd_update(w, %g, lr, weight_decay=0.0)
  return %e, %zero, %ws
}
"""


def test_fold_golden() -> None:
    # Folded: constant chains, uniform or not (only uniform ones become full). Not
    # folded: reads of the const input c. Removed: mul by 1, a transpose pair, a reshape
    # to the same shape. A reshape of a reshape becomes one node, but not w itself: w is
    # updated before the output %ws is read.
    _check_pass(fold_constants, FOLD_BEFORE, FOLD_EXPECTED)


FOLD_STOP_BEFORE = """
graph train_step(x: f32[4] input, w: f32[4] param, lr: f32[] state) {
  %h: f32[4] = mul(x, w)
  %s: f32[4] = stop_gradient(%h)
  %s2: f32[4] = stop_gradient(%s)
  %z: f32[4] = add(%s2, %h)
  %sw: f32[4] = stop_gradient(w)
  %y: f32[4] = mul(%sw, %z)
  %old: f32[4] = stop_gradient(w)
  %loss: f32[] = sum(%y, axes=None, keepdims=False)
  ! sgd_update(w, %z, lr, weight_decay=0.0)
  return %loss, %s, %old
}
"""

FOLD_STOP_EXPECTED = """
graph train_step(x: f32[4] input, w: f32[4] param, lr: f32[] state) {
  %h: f32[4] = mul(x, w)
  %z: f32[4] = add(%h, %h)
  %y: f32[4] = mul(w, %z)
  %old: f32[4] = stop_gradient(w)
  %loss: f32[] = sum(%y, axes=None, keepdims=False)
  ! sgd_update(w, %z, lr, weight_decay=0.0)
  return %loss, %h, %old
}
"""


def test_fold_removes_stop_gradient_after_autodiff() -> None:
    # A chain of stop_gradients and one read only before w's update are redirected to
    # their input (the output %s too); %old is a graph output, read after w's update, so
    # it keeps its copy of w's old value.
    _check_pass(fold_constants, FOLD_STOP_BEFORE, FOLD_STOP_EXPECTED)


def assert_folded(graph: Graph) -> None:
    """No identity left (but on a value that is updated, which must not be read past its
    update), and no elementwise node on constant fills alone."""
    producers = graph.producers()
    written = {n.inputs[j].name for n in graph.nodes for j in get_op(n.op).mutates}
    for node in graph.nodes:
        if not node.inputs or node.inputs[0].name in written:
            continue
        source, inner = node.inputs[0], producers.get(node.inputs[0].name)
        if node.op in ("reshape", "broadcast_to", "sum_to", "cast", "stop_gradient"):
            assert source.type != node.output.type, node
        if node.op == "transpose":
            assert node.attrs["perm"] != tuple(range(node.output.type.rank)), node
            assert inner is None or inner.op != "transpose" or inner.inputs[0].name in written
        if get_op(node.op).has(Fact.ELEMENTWISE):
            makers = [producers.get(v.name) for v in node.inputs]
            assert not all(m is not None and m.op == "full" for m in makers), node


# -- update reordering ----------------------------------------------------------------

REORDER_BEFORE = """
graph train_step(x: f32[4,3] input, w1: f32[3,3] param, w2: f32[3,2] param,
                 step: f32[] state, lr: f32[] state) {
  %h: f32[4,3] = matmul(x, w1)
  %z: f32[4,2] = matmul(%h, w2)
  %loss: f32[] = sum(%z, axes=None, keepdims=False)
  %gz: f32[4,2] = broadcast_to(%loss, shape=(4, 2))
  %w2t: f32[2,3] = transpose(w2, perm=(1, 0))
  %ht: f32[3,4] = transpose(%h, perm=(1, 0))
  %gw2: f32[3,2] = matmul(%ht, %gz)
  %gh: f32[4,3] = matmul(%gz, %w2t)
  %xt: f32[3,4] = transpose(x, perm=(1, 0))
  %gw1: f32[3,3] = matmul(%xt, %gh)
  %one: f32[] = full(shape=(), value=1.0, dtype='f32')
  %t: f32[] = add(step, %one)
  %lrt: f32[] = div(lr, %t)
  ! sgd_update(w1, %gw1, %lrt, weight_decay=0.0)
  ! sgd_update(w2, %gw2, %lrt, weight_decay=0.0)
  ! assign(step, %t)
  return %loss
}
"""

REORDER_EXPECTED = """
graph train_step(x: f32[4,3] input, w1: f32[3,3] param, w2: f32[3,2] param,
                 step: f32[] state, lr: f32[] state) {
  %one: f32[] = full(shape=(), value=1.0, dtype='f32')
  %t: f32[] = add(step, %one)
  ! assign(step, %t)
  %h: f32[4,3] = matmul(x, w1)
  %z: f32[4,2] = matmul(%h, w2)
  %loss: f32[] = sum(%z, axes=None, keepdims=False)
  %gz: f32[4,2] = broadcast_to(%loss, shape=(4, 2))
  %w2t: f32[2,3] = transpose(w2, perm=(1, 0))
  %ht: f32[3,4] = transpose(%h, perm=(1, 0))
  %gw2: f32[3,2] = matmul(%ht, %gz)
  %gh: f32[4,3] = matmul(%gz, %w2t)
  %lrt: f32[] = div(lr, %t)
  ! sgd_update(w2, %gw2, %lrt, weight_decay=0.0)
  %xt: f32[3,4] = transpose(x, perm=(1, 0))
  %gw1: f32[3,3] = matmul(%xt, %gh)
  ! sgd_update(w1, %gw1, %lrt, weight_decay=0.0)
  return %loss
}
"""


def test_reorder_golden() -> None:
    # w2's update waits for its gradient and for the read of its view %w2t, then runs
    # before w1's gradient. The step count needs nothing computed: it leads the graph,
    # and the learning rate derived from it travels with the first update.
    _check_pass(reorder_updates, REORDER_BEFORE, REORDER_EXPECTED)


def _batch_dependent(graph: Graph) -> set[str]:
    found = {v.name for v in graph.inputs_with_role(Role.INPUT)}
    for node in graph.nodes:
        if any(v.name in found for v in node.inputs):
            found.update(v.name for v in node.outputs)
    return found


def _dependencies(graph: Graph, index: int) -> set[int]:
    """Nodes that effect ``index`` must follow: producers of what it reads (transitively)
    and earlier readers of what it writes or of a view of it."""
    producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    deps: set[int] = set()
    stack = [index]
    while stack:
        for v in graph.nodes[stack.pop()].inputs:
            if v.name in producer and producer[v.name] not in deps:
                deps.add(producer[v.name])
                stack.append(producer[v.name])
    node = graph.nodes[index]
    aliases = {node.inputs[j].name for j in get_op(node.op).mutates}
    for i, other in enumerate(graph.nodes[:index]):
        if get_op(other.op).has(Fact.VIEW) and other.inputs[0].name in aliases:
            aliases.add(other.output.name)
        if any(v.name in aliases for v in other.inputs):
            deps.add(i)
    return deps


def assert_updates_early(graph: Graph) -> None:
    """Between each effect and its last dependency there are only other effects and
    nodes that depend on no batch input (the optimizer's own small computations)."""
    batch = _batch_dependent(graph)
    for e, node in enumerate(graph.nodes):
        if not get_op(node.op).effectful:
            continue
        last = max(_dependencies(graph, e), default=-1)
        for between in graph.nodes[last + 1 : e]:
            assert get_op(between.op).effectful or not any(
                v.name in batch for v in between.outputs
            ), (node, between)


# -- the invariants on random graphs and the pipeline ---------------------------------

INVARIANTS: dict[str, Callable[[Graph], None]] = {
    "fold_constants": assert_folded,
    "eliminate_common_subexpressions": assert_no_common_subexpressions,
    "reorder_updates": assert_updates_early,
}


@pytest.mark.parametrize("p", PASSES, ids=lambda p: p.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=random_graphs())
def test_pass_preserves_semantics(p: Pass, graph: Graph) -> None:
    verify(graph)
    after = verify(p(graph))
    assert_same_results(graph, after, feeds_for(graph), _close)
    check = INVARIANTS.get(p.__name__)
    if check is not None:
        check(after)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=random_graphs())
def test_pipeline_preserves_semantics(graph: Graph) -> None:
    result = run_pipeline(graph, check=True)
    assert [name for name, _ in result.stages] == ["input"] + [p.__name__ for p in DEFAULT_PIPELINE]
    assert_same_results(graph, result.graph, feeds_for(graph), _close)
    assert_no_common_subexpressions(result.graph)
    assert_updates_early(result.graph)


def test_default_pipeline_order() -> None:
    # folding feeds CSE, both leave dead code, reordering works on the final nodes; the
    # forward pipeline runs before autodiff
    assert list(FORWARD_PIPELINE) + list(DEFAULT_PIPELINE) == list(PASSES)


def test_passes_are_pure() -> None:
    graph = parse_graph(FOLD_BEFORE)
    text = str(graph)
    for p in PASSES:
        p(graph)
    assert str(graph) == text


# -- zoo training graphs ----------------------------------------------------------------


ZOO = [("mlp", "sgd"), ("mlp", "adamw"), ("cnn", "momentum"), ("bert", "adamw")]


@pytest.mark.parametrize(("name", "optimizer"), ZOO)
def test_zoo_stages(name: str, optimizer: str) -> None:
    """Each pass of the pipeline keeps the step's results and promises on a real graph."""
    stages = zoo_step(name, optimizer).stages
    feeds = feeds_for(stages[0][1])
    for (_, before), (pass_name, after) in itertools.pairwise(stages):
        verify(after)
        assert_same_results(before, after, feeds, _close)
        check = INVARIANTS.get(pass_name)
        if check is not None:
            check(after)


def _update_of(graph: Graph, param: str) -> int:
    for i, node in enumerate(graph.nodes):
        if get_op(node.op).effectful and node.inputs[0].name == param:
            return i
    raise AssertionError(f"no update of {param}")


def _gradient_producer(graph: Graph, param: str) -> int:
    producers = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    return producers[graph.nodes[_update_of(graph, param)].inputs[1].name]


def _first_read(graph: Graph, name: str) -> int:
    return next(i for i, n in enumerate(graph.nodes) if any(v.name == name for v in n.inputs))


@pytest.mark.parametrize(("name", "optimizer"), [("mlp", "sgd"), ("cnn", "momentum")])
def test_updates_precede_earlier_layers_backward(name: str, optimizer: str) -> None:
    graph = zoo_step(name, optimizer).graph
    # the MLP's last Linear is updated before the first Linear's weight gradient exists
    if name == "mlp":
        assert _update_of(graph, "4.weight") < _gradient_producer(graph, "0.weight")
    forward = dict(zoo_step(name, optimizer).stages)["input"]
    params = sorted(graph.trainable_params, key=lambda p: _first_read(forward, p.name))
    for i, early in enumerate(params):
        for late in params[i + 1 :]:
            if _first_read(forward, late.name) > _first_read(forward, early.name):
                assert _update_of(graph, late.name) < _gradient_producer(graph, early.name), (
                    late.name,
                    early.name,
                )


def test_updates_without_reordering_follow_the_backward() -> None:
    stages = dict(zoo_step("mlp", "sgd").stages)
    before = stages["eliminate_dead_code"]
    first_update = min(_update_of(before, p.name) for p in before.trainable_params)
    grads = [_gradient_producer(before, p.name) for p in before.trainable_params]
    assert first_update > max(grads)


# -- fusion -------------------------------------------------------------------------------

AFFINE_AFTER_CONV = """
graph g(x: f32[2,3,6,6] input, w: f32[4,3,3,3] param, b: f32[4] param,
        s: f32[4] param(frozen), h: f32[4] param) {
  %y: f32[2,4,4,4] = conv2d(x, w, b, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)
  %s3: f32[4,1,1] = reshape(s, shape=(4, 1, 1))
  %h3: f32[4,1,1] = reshape(h, shape=(4, 1, 1))
  %t: f32[2,4,4,4] = mul(%s3, %y)
  %z: f32[2,4,4,4] = add(%t, %h3)
  %r: f32[2,4,4,4] = relu(%z)
  return %r%extra
}
"""


def test_fold_channel_affine_folds_a_per_channel_scale_and_shift_into_the_conv() -> None:
    graph = verify(parse_graph(AFFINE_AFTER_CONV.replace("%extra", "")))
    after = verify(fold_channel_affine(graph))
    ops = [n.op for n in after.nodes]
    assert ops.count("conv2d") == 1 and ops[-2:] == ["conv2d", "relu"]
    conv = after.nodes[-2]
    assert conv.inputs[0].name == "x" and conv.inputs[1].shape == (4, 3, 3, 3)
    assert not any(n.op == "mul" and n.output.shape == (2, 4, 4, 4) for n in after.nodes)
    assert_same_results(graph, after, feeds_for(graph), _close_f32)


def test_fold_channel_affine_leaves_a_trained_scale_unfolded() -> None:
    """A scale computed from a trained param (a BatchNorm on running statistics whose
    scale trains) stays a per-channel multiply: folded, its gradient would need the
    convolution's whole weight gradient."""
    text = AFFINE_AFTER_CONV.replace("%extra", "").replace("param(frozen)", "param")
    graph = verify(parse_graph(text))
    assert fold_channel_affine(graph) is graph


@pytest.mark.parametrize("extra", [", %y", ", %t"])
def test_fold_channel_affine_leaves_values_read_elsewhere(extra: str) -> None:
    graph = verify(parse_graph(AFFINE_AFTER_CONV.replace("%extra", extra)))
    assert fold_channel_affine(graph) == graph


def _close_f32(a: Array, b: Array) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


LINEAR_BIAS = """
graph g(x: f32[6,4] input, w: f32[5,4] param, b: f32[5] param) {
  %wt: f32[4,5] = transpose(w, perm=(1, 0))
  %m: f32[6,5] = matmul(x, %wt)
  %z: f32[6,5] = add(%m, b)
  %r: f32[6,5] = relu(%z)
  return %r%extra
}
"""


def test_fuse_linear_bias_makes_one_linear_node() -> None:
    graph = verify(parse_graph(LINEAR_BIAS.replace("%extra", "")))
    after = verify(fuse_linear_bias(graph))
    assert [n.op for n in after.nodes] == ["transpose", "linear", "relu"]
    assert [v.name for v in after.nodes[1].inputs] == ["x", "wt", "b"]
    assert_same_results(graph, after, feeds_for(graph), _close_f32)


def test_fuse_linear_bias_leaves_a_product_read_elsewhere() -> None:
    graph = verify(parse_graph(LINEAR_BIAS.replace("%extra", ", %m")))
    assert fuse_linear_bias(graph) == graph
