"""The C step under a memory budget (``backends/c/budget_fit.py``) and the report's account
of the C step's own plan.

- ``step.report()`` of a C step shows its arena plan: F(4x4, 3x3)'s working memory (which
  the training graph's planned peak does not hold), the layout conversions.
- ``pe.compile(..., memory_budget=...)`` below that plan gives up working memory, the
  least that fits: one byte under it, one node of six; at the training graph's own peak,
  every one. The step then trains as NumPy does, and its report lists what was given up.
- An exported trainer of a step compiled under a budget leaves F(4x4, 3x3) out of the
  slots whose working memory would break it, and trains as the step does.
- A budget no arrangement meets keeps the lowest plan and warns; NHWC layouts are given up
  after working memory (a residual depthwise layer, whose conversions raise the peak).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine.backends.c import CBackend
from pockengine.backends.c.budget_fit import arrange, export_candidates, fit_budget
from pockengine.backends.c.lowering import lower_for_c
from pockengine.ir import CompileError, DType, Graph, GraphBuilder, Role, TensorType
from tests.conv_stacks import conv_stack
from tests.trainer_losses import trainer_losses

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


def _vgg() -> tuple[Any, Any, list[Any]]:
    """Three 3x3 convolutions of 32 channels on 10 x 10 maps of two images: F(4x4, 3x3) by
    the rule, forward, input and weight gradients (six nodes with working memory)."""
    return conv_stack((32, 32, 32), 10, 2, 3, norm_after=(1,))


def _step(backend: Any, budget: int | None = None) -> Any:
    model, loss_fn, batches = _vgg()
    opt = pe.optim.SGD(lr=0.05)
    return pe.compile(model, loss_fn, batches[0], opt, backend=backend, memory_budget=budget)


@pytest.fixture(scope="module")
def unbudgeted() -> Any:
    return _step("c").report()


def test_the_report_shows_the_c_steps_own_plan(unbudgeted: Any) -> None:
    memory = unbudgeted.backend_memory
    assert memory is not None and memory.backend == "C" and memory.budget is None
    assert memory.work_nodes == 6 and memory.work_bytes > 0 and not memory.given_up
    # the working memory is in the C plan, not in the training graph's
    assert memory.planned_peak_bytes > unbudgeted.ours.planned_peak_bytes
    text = str(unbudgeted)
    assert "C step's own plan: planned peak" in text and "working memory" in text
    assert unbudgeted.to_dict()["backend_memory"]["work_nodes"] == 6


@pytest.mark.parametrize("below", ["one byte", "the graph's peak"])
def test_a_budget_gives_up_the_least_working_memory_and_trains_as_numpy(
    below: str, unbudgeted: Any
) -> None:
    memory = unbudgeted.backend_memory
    graph_peak = unbudgeted.ours.planned_peak_bytes
    budget = memory.planned_peak_bytes - 1 if below == "one byte" else graph_peak
    step = _step("c", budget)
    got = step.report().backend_memory
    assert got.budget == budget and got.planned_peak_bytes <= budget
    given = len(got.given_up)
    assert given == 6 - got.work_nodes and given >= 1
    if below == "one byte":
        assert given < 6  # the rest keep F(4x4, 3x3)
        assert "winograd4_f32(" in step._exec.source
    else:
        assert "winograd4" not in step._exec.source
    assert all("instead of winograd4" in line for line in got.given_up)
    assert "given up to meet the budget" in str(step.report())
    want = _step("numpy")
    for inputs in _vgg()[2]:
        assert step(*inputs) == pytest.approx(want(*inputs), rel=1e-4, abs=1e-5)
    for name, value in want.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value, rtol=1e-4, atol=1e-5)


def test_an_unmet_budget_keeps_the_lowest_plan_and_warns(
    unbudgeted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "pockengine.backends.c.budget_fit"):
        step = _step("c", 1000)
    got = step.report().backend_memory
    assert got.work_nodes == 0 and len(got.given_up) == 6
    assert got.planned_peak_bytes < unbudgeted.backend_memory.planned_peak_bytes
    assert any("not met by the C step" in r.getMessage() for r in caplog.records)


def _depthwise_residual() -> Graph:
    """y = depthwise(x) + x on 4 x 4 maps of 64 channels: in NHWC, x stays alive beside
    its converted copy and the converted result, so the conversions raise the peak."""
    b = GraphBuilder("residual")
    f32, geom = DType.F32, {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1)}
    x = b.input("x", TensorType((4, 64, 4, 4), f32), Role.INPUT)
    w = b.input("w", TensorType((64, 1, 3, 3), f32), Role.INPUT)
    a = b.call("conv2d", x, w, groups=64, **geom)
    return lower_for_c(b.build([b.call("add", a, x)]))


def test_nhwc_layouts_are_given_up_when_their_conversions_break_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    graph = _depthwise_residual()
    convs = {n.outputs[0].name for n in graph.nodes if n.op.startswith("conv2d")}
    nchw, nhwc = arrange(graph, {}, ()), arrange(graph, {}, convs)
    assert nhwc.plan.planned_peak_bytes > nchw.plan.planned_peak_bytes
    assert any(n.op == "layout_convert" for n in nhwc.graph.nodes)
    fitted = fit_budget(graph, {}, convs, nchw.plan.planned_peak_bytes)
    assert fitted.plan.planned_peak_bytes == nchw.plan.planned_peak_bytes
    assert not any(n.op == "layout_convert" for n in fitted.graph.nodes)
    assert fitted.given_up == (f"{len(convs)} convolutions in NCHW instead of NHWC "
                               "(no layout conversions)",)  # fmt: skip
    assert fit_budget(graph, {}, convs, None) == nhwc
    with caplog.at_level(logging.WARNING, "pockengine.backends.c.budget_fit"):
        lowest = fit_budget(graph, {}, convs, 1)
    assert lowest.plan == nchw.plan and "not met" in caplog.text


def test_a_bad_budget_is_one_clear_error() -> None:
    for bad in (0, -5, 1.5, True, "600MB"):
        with pytest.raises(CompileError, match="memory_budget must be bytes > 0"):
            CBackend(memory_budget=bad)  # type: ignore[arg-type]
    assert CBackend(tune=True).under_budget(1 << 20).tune


def _export_plan(step: Any, limits: Any = None) -> int:
    """The planned peak of ``step``'s exported trainer, working memory for every kernel a
    slot may take (``limits``: as ``export_candidates`` gives them; None: every one)."""
    from pockengine.backends.c.layout import apply_layouts, heuristic_nhwc
    from pockengine.backends.c.plan_step import plan_step_memory
    from pockengine.backends.c.workspace import add_workspaces

    graph = lower_for_c(step.graph)
    graph = apply_layouts(graph, heuristic_nhwc(graph))
    kernels = limits or export_candidates(graph, None)
    worked = add_workspaces(graph, lambda n: kernels[n.outputs[0].name])
    return plan_step_memory(worked).planned_peak_bytes


def test_an_exported_trainer_keeps_a_budget_and_trains_as_the_step(tmp_path: Path) -> None:
    """A step compiled with a budget one byte under its trainer's plan exports a trainer
    whose slots leave F(4x4, 3x3) out where the plan needs the room (fewer winograd4 cases,
    a smaller plan, within the budget), and ./train trains as the step does."""

    from pockengine.backends.c.layout import apply_layouts, heuristic_nhwc

    full = _export_plan(_step("c"))
    step = _step("c", full - 1)
    graph = lower_for_c(step.graph)
    limits = export_candidates(apply_layouts(graph, heuristic_nhwc(graph)), full - 1)
    dropped = [k for k, v in limits.items() if "winograd4" not in v]
    assert dropped and len(dropped) < sum(1 for n in graph.nodes if n.op.startswith("conv2d"))
    assert _export_plan(step, limits) <= full - 1
    folder = step.export(tmp_path / "trainer", target="c")
    source = (folder / "step.c").read_text()
    for name, kernels in limits.items():  # each switch names F(4x4, 3x3) where it may take it
        line = next(x for x in source.splitlines() if f"v_{name}," in x and "switch" in x)
        assert ("winograd4" in line) == ("winograd4" in kernels), name
    batches = _vgg()[2]
    losses = [step(*b) for b in batches]
    np.testing.assert_allclose(trainer_losses(folder, batches), losses, rtol=1e-4)
