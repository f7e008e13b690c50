"""Plans: liveness, the static memory arena and the cost model, on hand-written, random
and zoo graphs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from pockengine.ir import Graph, parse_graph
from pockengine.plan import ALIGNMENT, MemoryPlan, cost, liveness, plan_memory
from tests.graphgen import random_graphs, zoo_step

CHAIN = """
graph chain(x: f32[16] input, w: f32[16] param, m: f32[16] state, lr: f32[] state,
            c: f32[4] const, f: f32[16] param(frozen)) {
  %a: f32[16] = mul(x, w)
  %b: f32[16] = tanh(%a)
  %c2: f32[16] = mul(%b, f)
  %d: f32[16] = neg(%c2)
  %unused: f32[16] = exp(%d)
  %s: f32[] = sum(%d, axes=None, keepdims=False)
  ! sgd_momentum_update(w, %d, m, lr, momentum=0.9, weight_decay=0.0, nesterov=False)
  return %s
}
"""


def test_liveness_intervals() -> None:
    live = liveness(parse_graph(CHAIN))
    spans = {name: (iv.start, iv.end) for name, iv in live.intervals.items()}
    # persistent inputs are not tracked; the batch input lives from the entry (-1);
    # %d's last read is the update (6); the output %s lives to the exit (7)
    assert spans == {
        "x": (-1, 0),
        "a": (0, 1),
        "b": (1, 2),
        "c2": (2, 3),
        "d": (3, 6),
        "unused": (4, 4),
        "s": (5, 7),
    }
    # node 4 holds %d and %unused, node 5 %d and %s: 64 + 64, 64 + 4
    assert live.live_bytes() == [128, 128, 128, 128, 128, 68, 68]
    assert live.peak_bytes == 128
    assert [v.name for v in live.live_at(5)] == ["d", "s"]


def test_memory_plan_reuses_dead_buffers() -> None:
    plan = plan_memory(parse_graph(CHAIN))
    # at most two 64-byte values live at once, so two slots suffice
    assert plan.peak_live_bytes == 128
    assert plan.arena_bytes == 128
    assert set(plan.offsets) == {"x", "a", "b", "c2", "d", "unused", "s"}
    # tanh, mul and neg each write over their dying input: one slot for a, b, c2 and d
    assert plan.offsets["a"] == plan.offsets["b"] == plan.offsets["c2"] == plan.offsets["d"]
    assert plan.offsets["x"] != plan.offsets["a"]  # both are read at node 0
    assert plan.offsets["x"] == plan.offsets["unused"]  # x died at node 0
    assert_valid(plan)


def test_memory_plan_persistent_breakdown() -> None:
    plan = plan_memory(parse_graph(CHAIN))
    assert (plan.param_bytes, plan.trained_param_bytes) == (128, 64)
    assert (plan.state_bytes, plan.const_bytes, plan.buffer_bytes) == (68, 16, 0)
    assert plan.persistent_bytes == 128 + 68 + 16
    assert plan.planned_peak_bytes == plan.arena_bytes + plan.persistent_bytes
    assert "planned peak" in str(plan)


def test_memory_plan_aligns_and_skips_empty_values() -> None:
    g = parse_graph("""
graph g(x: f32[3] input, e: f32[0] input) {
  %a: f32[] = sum(x, axes=None, keepdims=False)
  %b: f32[] = neg(%a)
  %c: f32[3] = mul(x, %b)
  %z: f32[0] = neg(e)
  return %c, %z
}
""")
    plan = plan_memory(g)
    assert "z" not in plan.offsets and "e" not in plan.offsets
    assert all(off % ALIGNMENT == 0 for off in plan.offsets.values())
    # x (12 bytes) lives throughout; b (4) and c (12) overlap it at node 2; neg writes b
    # over a, which dies there
    assert plan.peak_live_bytes == 12 + 4 + 12
    assert plan.arena_bytes == 3 * ALIGNMENT
    assert plan.offsets["a"] == plan.offsets["b"] != plan.offsets["c"]
    assert_valid(plan)


def assert_valid(plan: MemoryPlan) -> None:
    """No two simultaneously live values overlap in memory; the arena holds them all."""
    placed = [iv for iv in plan.liveness.intervals.values() if iv.nbytes > 0]
    assert set(plan.offsets) == {iv.value.name for iv in placed}
    for i, a in enumerate(placed):
        lo_a = plan.offsets[a.value.name]
        assert lo_a % ALIGNMENT == 0
        assert lo_a + a.nbytes <= plan.arena_bytes
        for b in placed[i + 1 :]:
            if a.overlaps(b):
                lo_b = plan.offsets[b.value.name]
                assert lo_a + a.nbytes <= lo_b or lo_b + b.nbytes <= lo_a, (a, b)
    assert plan.arena_bytes >= plan.peak_live_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=random_graphs(max_nodes=40))
def test_memory_plan_on_random_graphs(graph: Graph) -> None:
    plan = plan_memory(graph)
    assert_valid(plan)
    live = plan.liveness
    by_hand = [sum(v.type.nbytes for v in live.live_at(t)) for t in range(-1, live.num_nodes + 1)]
    assert live.peak_bytes == max(by_hand)
    assert live.live_bytes() == by_hand[1:-1]


def test_cost_counts_flops_and_bytes() -> None:
    g = parse_graph("""
graph g(x: f32[8,4] input, w: f32[4,2] param) {
  %z: f32[8,2] = matmul(x, w)
  %t: f32[2,8] = transpose(%z, perm=(1, 0))
  return %t
}
""")
    c = cost(g)
    assert [n.flops for n in c.nodes] == [2 * 8 * 2 * 4, 0]
    assert c.nodes[0].bytes_read == (32 + 8) * 4 and c.nodes[0].bytes_written == 16 * 4
    assert c.flops == 128
    assert c.bytes_read == sum(n.bytes_read for n in c.nodes)
    assert c.flops_by_phase() == {"forward": 128, "backward": 0, "update": 0}


def test_cost_of_updates_counts_written_state() -> None:
    c = cost(parse_graph(CHAIN))
    update = c.nodes[-1]
    assert update.phase == "update" and update.op == "sgd_momentum_update"
    assert update.bytes_written == 2 * 64  # the param and its momentum buffer
    assert update.flops == 4 * 16


ZOO = [
    ("mlp", "sgd"),
    ("mlp", "adamw"),
    ("cnn", "momentum"),
    ("bert", "adamw"),
    ("mbv2", "momentum"),
]


@pytest.mark.parametrize(("name", "optimizer"), ZOO)
def test_reordering_lowers_the_planned_peak(name: str, optimizer: str) -> None:
    step = zoo_step(name, optimizer)
    before = plan_memory(dict(step.stages)["eliminate_dead_code"])
    after = plan_memory(step.graph)
    assert_valid(after)
    assert after.peak_live_bytes <= before.peak_live_bytes
    assert after.planned_peak_bytes <= before.planned_peak_bytes
    assert after.persistent_bytes == before.persistent_bytes


def _gradient_byte_steps(graph: Graph) -> int:
    """The sum over gradients of bytes times the nodes they stay alive."""
    live = liveness(graph)
    grads = [n.inputs[1].name for n in graph.nodes if n.op.endswith("_update")]
    return sum(live.intervals[g].nbytes * (live.intervals[g].end - live.intervals[g].start)
               for g in grads)  # fmt: skip


@pytest.mark.parametrize(("name", "optimizer"), ZOO)
def test_gradients_die_sooner(name: str, optimizer: str) -> None:
    step = zoo_step(name, optimizer)
    before = dict(step.stages)["eliminate_dead_code"]
    assert _gradient_byte_steps(step.graph) < _gradient_byte_steps(before) / 2


def test_zoo_cost_phases() -> None:
    c = cost(zoo_step("cnn", "momentum").graph)
    phases = c.flops_by_phase()
    assert phases["backward"] > phases["forward"] > 0 < phases["update"]
    assert c.flops == sum(phases.values())
