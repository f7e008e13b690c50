"""The README's path for a new user works as written: a resumed ``--scheme auto`` run
compiles in a child like a fresh one, ``pockengine evaluate`` without matplotlib prints its
results and exits 0, and help says what the code does."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import pockengine as pe
from pockengine.cli import main
from pockengine.finetune.running import launch, trainer
from tests.test_finetune_resume import write_task


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return {**write_task(tmp_path), "epochs": 1, "max_train": 48}


def test_a_resumed_auto_run_compiles_in_a_child(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "run")
    pe.finetune(**task, scheme="auto", out=out, max_steps=2, compile_in="process")
    chosen = json.loads((tmp_path / "run" / "summary.json").read_text())["auto_scheme"]
    jobs: list[Any] = []
    real = launch.compile_in_child

    def recorded(config: Any, scheme: Any, folder: Path) -> Any:
        jobs.append(scheme)
        return real(config, scheme, folder)

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the resumed run compiled in the training process")

    monkeypatch.setattr(launch, "compile_in_child", recorded)
    monkeypatch.setattr(trainer, "train_here", not_here)
    result = pe.finetune(**task, scheme="auto", out=out, resume=True)
    assert len(jobs) == 1 and jobs[0] is not None  # the checkpoint's scheme, no new analysis
    assert jobs[0].to_dict() == chosen["scheme"]
    assert result.stopped is None and result.steps > 2
    assert result.auto_scheme is not None and "resumed" in json.dumps(result.auto_scheme)


def test_evaluate_without_matplotlib_notes_the_picture(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "run"
    pe.finetune(**task, out=str(out), max_steps=2, compile_in="process")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    capsys.readouterr()
    assert main(["evaluate", str(out), "--factory", task["model"]]) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and f"wrote {out / 'eval.json'}" in printed
    notes = [line for line in printed.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "confusion.png" in notes[0] and "matplotlib" in notes[0]
    assert (out / "eval.json").is_file() and not (out / "confusion.png").exists()
