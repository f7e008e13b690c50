"""Recomputation under a memory budget (``passes.remat_budget``, ``compile(memory_budget=)``).

- a budget below the plan of a small LLaMA brings its planned peak under the budget, by
  recomputing matmuls (whole block internals), not only elementwise chains;
- losses, gradients, updated params and optimizer state are bit for bit those of the step
  without a budget, over several steps, on the NumPy and torch backends;
- the report lists the recomputed segments, their FLOPs and the peak before and after;
- a BERT with dropout: the recomputed masks are the same masks (identical training);
- a budget above the plan changes nothing; one that cannot be met keeps the best plan and
  says how far it is; sizes are read as "600MB" or bytes, bad ones named.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.finetune.cli import budget_or_none, byte_amount
from pockengine.ir import CompileError, Graph, Node, Phase, verify
from pockengine.passes.remat_budget import FitMemoryBudget, parse_budget
from pockengine.plan import plan_memory

STEPS = 3
# The LLaMA tests' budget, a fraction of the plan without one: low enough that matmuls are
# recomputed, high enough to be met (about 0.72 is the least the pass reaches here)
LLAMA_FRACTION = 0.75


def _llama() -> zoo.Workload:
    return zoo.llama_lm(layers=2, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=32, seq=32,
                        batch=2)  # fmt: skip


def _bert() -> zoo.Workload:
    return zoo.bert_classifier(layers=2, hidden=16, heads=2, ffn=32, seq=32, batch=4, vocab=50,
                               dropout=0.1)  # fmt: skip


_WORKLOADS = {"llama": _llama, "bert": _bert}


def _compile(name: str, backend: str, budget: int | None) -> tuple[pe.TrainStep, zoo.Workload]:
    work = _WORKLOADS[name]()
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(lr=1e-2),
                      pe.schemes.full(), backend=backend, memory_budget=budget)  # fmt: skip
    return step, work


@functools.cache
def _reference(name: str, backend: str = "numpy") -> tuple[Graph, int, dict[str, Any]]:
    """The step without a budget: its graph, planned peak and training run."""
    step, work = _compile(name, backend, None)
    return step.graph, plan_memory(step.graph).planned_peak_bytes, _train(step, work)


def _base_peak(name: str) -> int:
    return _reference(name)[1]


def _train(step: pe.TrainStep, work: zoo.Workload) -> dict[str, Any]:
    grads = step.gradients(*work.make_batch(99))
    losses = [step(*work.make_batch(k)) for k in range(STEPS)]
    return {"losses": losses, "grads": grads, "state": step.flat_state_dict(),
            "optimizer": step.optimizer_state()}  # fmt: skip


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    for key in ("grads", "state", "optimizer"):
        assert a[key].keys() == b[key].keys()
        for name, value in a[key].items():
            np.testing.assert_array_equal(b[key][name], value, err_msg=f"{key} {name}")


def _recomputed(step: pe.TrainStep) -> list[Node]:
    """The nodes the budget pass inserted."""
    k = next(i for i, p in enumerate(step.passes) if isinstance(p, FitMemoryBudget))
    made = {v.name for n in step.stages[k][1].nodes for v in n.outputs}
    return [n for n in step.graph.nodes if n.outputs and n.outputs[0].name not in made]


@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_llama_fits_the_budget_bit_for_bit(backend: str) -> None:
    budget = int(LLAMA_FRACTION * _base_peak("llama"))
    step, work = _compile("llama", backend, budget)
    verify(step.graph)
    assert plan_memory(step.graph).planned_peak_bytes <= budget
    nodes = _recomputed(step)
    assert {"matmul", "linear"} & {n.op for n in nodes}  # more than elementwise chains
    assert all(n.phase is Phase.BACKWARD for n in nodes)
    _assert_identical(_reference("llama", backend)[2], _train(step, work))


def test_report_lists_segments_and_peaks() -> None:
    base = _base_peak("llama")
    step, _ = _compile("llama", "numpy", int(LLAMA_FRACTION * base))
    remat = step.report().recomputation
    assert remat is not None and remat.met
    assert (
        remat.peak_before == base and remat.peak_after == plan_memory(step.graph).planned_peak_bytes
    )
    assert remat.segments and remat.extra_flops == sum(s.flops for s in remat.segments) > 0
    assert sum(len(s.ops) for s in remat.segments) == len(_recomputed(step))
    assert any(s.layer.startswith("model.layers.") for s in remat.segments)
    text = str(step.report())
    assert "recomputation for a memory budget" in text and remat.segments[0].layer in text
    assert step.report().to_dict()["recomputation"]["extra_flops"] == remat.extra_flops


@pytest.mark.slow
def test_bert_with_dropout_recomputes_the_same_masks() -> None:
    budget = int(0.8 * _base_peak("bert"))
    step, work = _compile("bert", "numpy", budget)
    assert plan_memory(step.graph).planned_peak_bytes <= budget
    assert "random_mask" in {n.op for n in _recomputed(step)}  # masks recomputed, not saved
    _assert_identical(_reference("bert")[2], _train(step, work))


def test_budget_above_the_plan_changes_nothing() -> None:
    step, _ = _compile("llama", "numpy", _base_peak("llama") + 1)
    assert step.graph == _reference("llama")[0]
    remat = step.report().recomputation
    assert remat is not None and remat.met and not remat.segments


def test_unmeetable_budget_keeps_the_best_plan(caplog: pytest.LogCaptureFixture) -> None:
    base = _base_peak("llama")
    with caplog.at_level(logging.WARNING, logger="pockengine.passes.remat_budget"):
        step, _ = _compile("llama", "numpy", 1 << 10)
    assert "not met" in caplog.text and "over" in caplog.text
    peak = plan_memory(step.graph).planned_peak_bytes
    assert peak < base
    remat = step.report().recomputation
    assert remat is not None and not remat.met and remat.peak_after == peak
    assert "NOT met" in str(step.report())


def test_budget_sizes() -> None:
    assert parse_budget("600MB") == 600 << 20
    assert parse_budget("1.5GiB") == 3 << 29
    assert parse_budget(12345) == 12345
    assert parse_budget(None) is None
    assert parse_budget("2e3k") == 2000 << 10
    for bad in ("lots", "-5MB", 0, "1e400", float("inf"), float("nan"), "1.2.3MB"):
        with pytest.raises(CompileError, match="memory_budget"):
            parse_budget(bad)


def test_cli_sizes_follow_the_same_rule() -> None:
    """``--memory-budget``/``--remat-budget`` read sizes as ``memory_budget`` does, and a
    size that is not finite and positive is an argparse error, not a traceback."""
    assert byte_amount("300MB") == 300 << 20
    assert budget_or_none("none") == 0.0
    for bad in ("-5", "nan", "0", "1e400", "10XB"):
        with pytest.raises(argparse.ArgumentTypeError, match="as a size > 0"):
            byte_amount(bad)


def test_finetune_flag_reaches_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from pockengine.finetune.cli import add_arguments, config_from_args
    from pockengine.finetune.compiling import task_step

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--remat-budget", "600MB"]))
    assert config.remat_budget == 600 << 20 and config.memory_budget is None
    seen: dict[str, Any] = {}
    monkeypatch.setattr("pockengine.step.compiler.compile", lambda *a, **kw: seen.update(kw))
    work = _llama()
    task = argparse.Namespace(train=(work.make_batch(0)[0].numpy(),), model=work.model,
                              loss_fn=work.loss_fn, buckets=())  # fmt: skip
    config = dataclasses.replace(config, batch_size=1)
    task_step.compile_task(config, task, pe.schemes.full())  # type: ignore[arg-type]
    assert seen["memory_budget"] == 600 << 20
