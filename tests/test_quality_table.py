"""benchmarks/quality_table.py: the rows it reads back from finished runs (``--collect``,
for a table run in parts or cut short), what it reports of ``--scheme auto``'s choice;
benchmarks/pydocs_topics.py: the generic 6-topic task built from the installed docs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # their shared _harness
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def table() -> ModuleType:
    return _load("quality_table")


def _summary(accuracy: float, peak: float, auto: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"test": {"test_accuracy": accuracy, "test_loss": 1.0 - accuracy},
            "trained_params": 10, "planned_peak_bytes": peak, "peak_rss_bytes": 2 * peak,
            "wall_s": 5.0, "auto_scheme": auto}  # fmt: skip


def _auto(ratio: float) -> dict[str, Any]:
    return {"base": "bias", "budget_bytes": 2.0 * (1 << 20), "planned_peak_bytes": 1 << 20,
            "seconds": 3.0, "notes": ["a note"],
            "candidates": [{"param": "a.weight", "ratio": ratio},
                           {"param": "b.weight", "ratio": 0.0}]}  # fmt: skip


def _write(work: Path, name: str, seed: int, summary: dict[str, Any]) -> None:
    (work / f"{name}-seed{seed}").mkdir(parents=True)
    (work / f"{name}-seed{seed}" / "summary.json").write_text(json.dumps(summary))


def test_collect_reads_the_finished_seeds_only(table: ModuleType, tmp_path: Path) -> None:
    lr = {"lr": 1e-3, "trials": [{"lr": 1e-3, "val_loss": 0.5}]}
    (tmp_path / "lr-generic-auto.json").write_text(json.dumps(lr))
    _write(tmp_path, "generic-auto", 0, _summary(0.8, 1 << 20, _auto(1.0)))
    _write(tmp_path, "generic-auto", 2, _summary(0.6, 1 << 20, _auto(0.5)))
    (tmp_path / "lr-generic-full.json").write_text(json.dumps(lr))
    _write(tmp_path, "generic-full", 1, {**_summary(0.9, 1), "stopped": "signal", "test": {}})
    args = argparse.Namespace(work=str(tmp_path), seeds=[0, 1, 2])
    assert table.collected("generic", "full", args) is None
    assert table.collected("generic", "sparse", args) is None
    got = table.collected("generic", "auto", args)
    assert got is not None and got[0] == lr and len(got[1]) == 2
    r = table.row("generic", "auto", *got)
    assert r["values"] == [0.8, 0.6] and r["mean"] == pytest.approx(0.7)
    assert r["std"] == pytest.approx(0.1414213, rel=1e-5)
    assert r["planned_peak_mib"] == 1.0 and r["peak_rss_mib"] == 2.0
    # what auto trained in each run, and the budget it met
    assert [c["weights"] for c in r["auto_choice"]] == [{"a.weight": 1.0}, {"a.weight": 0.5}]
    assert r["auto_choice"][0]["budget_mib"] == 2.0 and r["analysis_s"] == 3.0
    text = table.markdown([r], "cmd")
    assert "| auto | 0.001 | 2 | 70.0 ± 14.1 |" in text


def test_the_topics_task_is_balanced_clean_and_seeded() -> None:
    topics = _load("pydocs_topics")
    if not topics.LIBRARY.is_dir():
        pytest.fail(f"{topics.LIBRARY} is missing: install python3.11-doc")
    rows = topics.build(per_class=30, seed=0)
    assert Counter(label for _, label in rows) == {c: 30 for c in topics.CHAPTERS}
    assert all(78 <= len(text) <= 600 for text, _ in rows)  # 80-600 before a closing "::"
    assert not any(":func:" in text or "``" in text or text[:3] == ".. " for text, _ in rows)
    assert len({text for text, _ in rows}) == len(rows)
    assert topics.build(per_class=30, seed=0) == rows != topics.build(per_class=30, seed=1)


def test_a_run_stopped_early_is_resumed_not_read(
    table: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``last:K`` names its folder without the colon; a stopped run (a signal) with a
    checkpoint is run again with ``--resume``, and its finished summary is what comes back."""
    out = tmp_path / "generic-last_4-seed1"
    out.mkdir()
    (out / "checkpoint.safetensors").write_bytes(b"")
    (out / "summary.json").write_text(json.dumps({**_summary(0.5, 1), "stopped": "SIGTERM"}))
    commands: list[list[str]] = []

    def finish(command: list[str], **_: Any) -> None:
        commands.append(command)
        (out / "summary.json").write_text(json.dumps(_summary(0.75, 1)))

    monkeypatch.setattr(table.subprocess, "run", finish)
    args = argparse.Namespace(work=str(tmp_path), model="M", data="D.csv", max_train=8,
                              batchnorm="batch", max_val=None, epochs=1, seq_len=None,
                              batch_size=None, image_size=None, backend="torch", test_fraction=0.5,
                              threads=1)  # fmt: skip
    got = table.run_one("generic", "last:4", 1e-3, 1, args)
    assert got["test"]["test_accuracy"] == 0.75
    [command] = commands
    assert command[-1] == "--resume" and command[command.index("--scheme") + 1] == "last:4"
    assert table.run_one("generic", "last:4", 1e-3, 1, args) == got  # finished: not re-run
    assert len(commands) == 1
    (out / "summary.json").write_text(json.dumps({**_summary(0.5, 1), "stopped": "SIGTERM"}))
    monkeypatch.setattr(table.subprocess, "run", lambda command, **_: None)
    with pytest.raises(SystemExit, match="stopped before its test metrics"):
        table.run_one("generic", "last:4", 1e-3, 1, args)


def test_auto_budget_and_batchnorm_reach_the_runs_that_take_them(table: ModuleType) -> None:
    """``--auto-budget`` is auto's ``--memory-budget`` only; ``--batchnorm`` reaches every
    run when given, and none otherwise (the recipe's default then)."""
    args = argparse.Namespace(max_train=8, max_val=None, epochs=1, seq_len=None,
                              batch_size=None, image_size=None, backend="torch",
                              test_fraction=0.5, batchnorm="running",
                              auto_budget="46MB")  # fmt: skip
    auto, sparse = table._options(args, "auto"), table._options(args, "sparse")
    assert auto[auto.index("--memory-budget") + 1] == "46MB"
    assert "--memory-budget" not in sparse
    assert sparse[sparse.index("--batchnorm") + 1] == "running"
    args.batchnorm = args.auto_budget = None
    assert not {"--batchnorm", "--memory-budget"} & set(table._options(args, "auto"))
