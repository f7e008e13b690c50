"""step_bench's artifact frameworks (benchmarks/step_artifact.py), run as step_bench runs a
case (``step_bench.py --case``, its own process): a child compiles and saves the step, the
measuring process loads and trains it without the compiler."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.plan.memory import plan_memory

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def artifact() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling _harness
    spec = importlib.util.spec_from_file_location(
        "step_artifact", ROOT / "benchmarks" / "step_artifact.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_process(backend: str, steps: int) -> tuple[float, Any, int]:
    """The last of ``steps`` losses of the mlp's full step compiled here, its graph, and the
    bytes of the model's params."""
    work, optimizer = zoo.benchmark("mlp")
    scheme = zoo.benchmark_schemes("mlp")["full"]
    batch = work.make_batch(0)
    weights = sum(p.numel() * p.element_size() for p in work.model.parameters())
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend)
    losses = [step(*batch) for _ in range(steps)]
    return losses[-1], step.graph, int(weights)


def _check(artifact: ModuleType, backend: str) -> dict[str, Any]:
    case = ["--case", "mlp", "full", f"pockengine-{backend}-artifact", "--steps", "2",
            "--warmup", "1", "--threads", "1"]  # fmt: skip
    row = artifact.run_child([ROOT / "benchmarks" / "step_bench.py", *case], 1)
    loss, graph, weights = _in_process(backend, 3)
    assert row["loss"] == pytest.approx(loss, rel=1e-6)  # the same three steps, loaded
    assert row["weights_mib"] * 2**20 == weights  # the weights every other idle process holds
    plan = plan_memory(graph)
    planned = (plan.arena_bytes + plan.state_bytes + plan.const_bytes) / 2**20
    assert row["planned_train_mib"] == pytest.approx(planned)
    assert np.isfinite(row["train_mem_mib"]) and row["peak_rss_mib"] > row["base_rss_mib"]
    return dict(row)


def test_torch_artifact_case_trains_the_saved_step(artifact: ModuleType) -> None:
    assert artifact.backend_of("pockengine-torch-artifact") == "torch"
    row = _check(artifact, "torch")
    assert row["framework"] == "pockengine-torch-artifact" and row["torch_imported"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_artifact_case_never_imports_torch(artifact: ModuleType) -> None:
    row = _check(artifact, "c")
    assert not row["torch_imported"]  # numpy, pockengine and the compiled step only
