"""Selective recomputation under a memory budget (``passes.remat_select``,
``passes.remat_merge``), on a LoRA step of a small LLaMA with int4 frozen weights:

- ``keep_order`` ranks the last block's values first, and in each block the projections'
  outputs (2 * 64 FLOPs an element) before the attention's output and log-sum-exp (about
  4 * 16: cheaper per byte to make again);
- a budget a little below the plan without one is met by keeping the last blocks whole,
  recomputing the first ones and keeping part of one block: an MLP projection's output
  is kept there while its attention is recomputed; the losses are those of the step
  without a budget, on the NumPy and C backends;
- no recomputation is repeated: each checkpointed layer recomputes its attention once
  (its output and log-sum-exp together), and no recomputed node repeats one whose copy
  is alive where it is made.
"""

from __future__ import annotations

import functools
import re

import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.ir import Graph, Node, Phase, Value, get_op
from pockengine.passes.remat_budget import FitMemoryBudget, block_targets
from pockengine.passes.remat_select import SavedValues, keep_order
from pockengine.plan import plan_memory
from pockengine.plan.liveness import last_reads
from tests.remat_lora import compile_lora, layer_of, step_losses

LAYERS = 3
BLOCK_FRACTION = 0.9  # of the plan without a budget: room for the last two blocks and a part
REPEAT_FRACTION = 0.8  # the first block recomputed whole
_RECOMPUTED = re.compile(r"_re[0-9]+$")
_PRODUCTS = frozenset({"matmul", "linear", "dequantize_matmul"})
_VIEWS = frozenset({"reshape", "transpose", "add"})  # a LoRA sum, RoPE: on a product


def _work() -> zoo.Workload:
    # a short sequence, as in SmolLM2 at 128 tokens and 576 wide: a projection's output costs
    # more FLOPs per byte (2 * hidden) than the attention's (about 4 * seq)
    return zoo.llama_lm(layers=LAYERS, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=16,
                        batch=4)  # fmt: skip


def _compile(backend: str, budget: int | None) -> tuple[pe.TrainStep, zoo.Workload]:
    work = _work()
    return compile_lora(work, backend, budget), work


@functools.cache
def _before(backend: str) -> tuple[Graph, FitMemoryBudget, int]:
    """The graph the budget pass is given, the pass (its ``finish``), and the planned peak
    without a budget."""
    step, _ = _compile(backend, 1 << 40)  # a budget above the plan: nothing recomputed
    k = next(i for i, p in enumerate(step.passes) if isinstance(p, FitMemoryBudget))
    fit = step.passes[k]
    assert isinstance(fit, FitMemoryBudget)
    before = step.stages[k][1]
    return before, fit, fit.peak(before)


def _pure(node: Node, v: Value) -> bool:
    return not get_op(node.op).effectful


def _makes_a_product(node: Node, producers: dict[str, Node]) -> bool:
    """Is ``node`` a product, or a view or sum of one (a projection's output)?"""
    while node.op in _VIEWS:
        inputs = [producers[v.name] for v in node.inputs if v.name in producers]
        if any(n.op in _PRODUCTS for n in inputs):
            return True
        if not inputs:
            return False
        node = inputs[0]
    return node.op in _PRODUCTS


def test_keep_order_ranks_the_last_block_and_its_projections_first() -> None:
    graph, _, _ = _before("numpy")
    saved = SavedValues.of(graph)
    blocks = block_targets(graph, saved)
    order = keep_order(saved, blocks)
    producers = graph.producers()
    layers = [layer_of(producers[group[0]].source) for group in order]
    assert layers == sorted(layers, reverse=True) and layers[0] == LAYERS - 1
    for k in range(LAYERS):
        ops = [producers[g[0]].op for g, layer in zip(order, layers, strict=True) if layer == k]
        products = [i for i, g in enumerate(order) if layers[i] == k
                    and _makes_a_product(producers[g[0]], producers)]  # fmt: skip
        attention = [i for i, g in enumerate(order) if layers[i] == k
                     and producers[g[0]].op == "attention"]  # fmt: skip
        assert "attention" in ops and len(attention) == 1  # output and lse: one group
        assert products and max(products) < attention[0]


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_budget_inside_a_block_keeps_its_projections(backend: str) -> None:
    graph, _, base = _before(backend)
    blocks = block_targets(graph)
    budget = int(BLOCK_FRACTION * base)
    step, work = _compile(backend, budget)
    final = step.graph
    assert plan_memory(final).planned_peak_bytes <= budget
    read = {v.name for n in final.nodes if n.phase is Phase.BACKWARD for v in n.inputs}
    producers = graph.producers()
    made = {n for b in blocks for n in b if producers[n].inputs}  # not a creation node
    cut = [b & made for b in blocks if b & made & read and (b & made) - read]
    assert len(cut) == 1  # one block partly kept
    kept, recomputed = cut[0] & read, cut[0] - read
    sources = {producers[n].source.rsplit(".", 1)[-1] for n in kept}
    assert sources & {"gate_proj", "up_proj"}  # an MLP projection's output is kept ...
    assert "attention" in {producers[n].op for n in recomputed}  # ... its attention is not
    k = next(i for i, b in enumerate(blocks) if b & made == cut[0])
    assert not set().union(*blocks[:k]) & made & read  # earlier blocks: recomputed whole
    assert set().union(*blocks[k + 1 :]) <= read  # later blocks: kept whole
    assert step_losses(step, work) == step_losses(*_compile(backend, None))


def test_no_recomputation_is_repeated() -> None:
    _, _, base = _before("numpy")
    step, _ = _compile("numpy", int(REPEAT_FRACTION * base))
    graph = step.graph
    assert plan_memory(graph).planned_peak_bytes <= int(REPEAT_FRACTION * base)
    recomputed = [(i, n) for i, n in enumerate(graph.nodes)
                  if n.phase is Phase.BACKWARD and n.outputs
                  and all(_RECOMPUTED.search(v.name) for v in n.outputs)]  # fmt: skip
    attention = [layer_of(n.source) for _, n in recomputed if n.op == "attention"]
    assert sorted(attention) == sorted(set(attention)) and attention  # once per layer
    last = last_reads(graph)
    made: dict[tuple[str, tuple[str, ...], str], Node] = {}
    for i, node in recomputed:
        key = (node.op, tuple(v.name for v in node.inputs), repr(sorted(node.attrs.items())))
        earlier = made.get(key)
        assert earlier is None or any(last[v.name] < i for v in earlier.outputs), node
        made[key] = node
