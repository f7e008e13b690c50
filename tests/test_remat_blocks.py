"""Block checkpointing under a memory budget (``passes.remat_budget.block_targets``).

A LoRA step of a small LLaMA on int4 frozen weights, whose activations dominate its plan:

- each transformer layer's saved values are its internals only: nothing another block
  (or the head) reads, so the residual stream and the shared mask stay saved;
- with every block checkpointed the planned peak is below the step's without a budget by
  most of the saved activations; a budget at that figure is met, each block's recomputed
  values die before the next block's backward begins (the plan sees one block's working
  set at a time), and the losses are those of the step without a budget, on the NumPy and
  C backends.
"""

from __future__ import annotations

import functools
import re

import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.ir import Graph, Phase
from pockengine.passes.remat_budget import block_targets
from pockengine.plan import plan_memory
from tests.remat_lora import compile_lora, layer_of, step_losses

LAYERS = 3
_ORIGINAL = re.compile(r"_re[0-9]+$")


def _work() -> zoo.Workload:
    return zoo.llama_lm(layers=LAYERS, hidden=32, heads=4, kv_heads=2, ffn=96, vocab=64, seq=64,
                        batch=2)  # fmt: skip


def _compile(backend: str, budget: int | None) -> tuple[pe.TrainStep, zoo.Workload]:
    work = _work()
    return compile_lora(work, backend, budget), work


def test_block_targets_are_the_internals_of_eachlayer_of() -> None:
    step, _ = _compile("numpy", None)
    graph = step.graph
    blocks = block_targets(graph)
    assert len(blocks) == LAYERS
    producers = graph.producers()
    forward = [n for n in graph.nodes if n.phase is not Phase.BACKWARD]
    for k, names in enumerate(blocks):
        assert names and {layer_of(producers[n].source) for n in names} == {k}
        readers = {layer_of(n.source) for n in forward for v in n.inputs if v.name in names}
        assert readers == {k}  # nothing outside the block reads them
    # the values a layer hands on (its output: the next residual) are not targets
    outputs = {v.name for n in forward if layer_of(n.source) is not None for v in n.outputs}
    handed = {v.name for n in forward if layer_of(n.source) is None for v in n.inputs}
    assert outputs & handed and not (outputs & handed) & set().union(*blocks)


@functools.cache
def _reference(backend: str) -> tuple[Graph, list[float]]:
    """The step without a budget: its graph and losses."""
    step, work = _compile(backend, None)
    return step.graph, step_losses(step, work)


@pytest.mark.parametrize("backend", ["numpy", "c", pytest.param("torch", marks=pytest.mark.slow)])
def test_checkpointed_blocks_meet_the_budget_one_block_at_a_time(backend: str) -> None:
    reference, losses = _reference(backend)
    budget = int(0.6 * plan_memory(reference).planned_peak_bytes)
    step, work = _compile(backend, budget)
    graph = step.graph
    assert plan_memory(graph).planned_peak_bytes <= budget
    recomputed = [(i, n) for i, n in enumerate(graph.nodes) if layer_of(n.source) is not None
                  and any(_ORIGINAL.search(v.name) for v in n.outputs)]  # fmt: skip
    layers = {layer_of(n.source) for _, n in recomputed}
    assert layers == set(range(LAYERS))  # every block repeated from its input
    # projections are repeated; the attention's output, dearer per byte than a projection's
    # here (a 64-token sequence, 32 wide), is what the budget's room keeps
    assert ("dequantize_matmul" if backend == "c" else "matmul") in {n.op for _, n in recomputed}
    # block k's copies of its own internals are dead before block k-1 recomputes (on C, a
    # copy of a target may be folded into an elementwise chain: the block's chains count)
    targets = block_targets(reference)
    last = {name: i for i, n in enumerate(graph.nodes) for name in (v.name for v in n.inputs)}
    own = [{i: [v.name for v in n.outputs if _ORIGINAL.sub("", v.name) in targets[k]
                or (n.op == "elementwise_chain" and layer_of(n.source) == k)]
            for i, n in recomputed} for k in range(LAYERS)]  # fmt: skip
    for k in range(1, LAYERS):
        starts = min(i for i, names in own[k - 1].items() if names)
        copies = [name for names in own[k].values() for name in names]
        assert copies and all(last.get(name, -1) < starts for name in copies)
    assert step_losses(step, work) == losses  # the same kernels on the same values: same bits
