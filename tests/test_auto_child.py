"""``--scheme auto`` with ``--compile-in child`` (the default): the compile child chooses
the scheme, then compiles its choice, so the process that trains holds no torch while it
runs and the task is built once; the run trains exactly what an in-process auto run
trains, and reports the same choice; the analysis' error is raised here as the class it
was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import pockengine as pe
from pockengine.finetune.run_folder import checkpoint
from pockengine.tasks.config import FinetuneError
from tests.test_auto_scheme import FACTORY
from tests.test_compile_child import _finetune_in_a_fresh_process, _same_checkpoint
from tests.test_sensitivity import _dataset


@pytest.fixture
def options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("PE_CACHE", str(tmp_path / "cache"))
    return {"model": FACTORY, "data": str(_dataset(tmp_path / "topics.csv")), "batch_size": 8,
            "seq_len": 8, "max_train": 72, "epochs": 1, "backend": "torch", "progress": "none",
            "scheme": "auto", "test_fraction": 0.5}  # fmt: skip


def test_an_auto_run_chooses_and_compiles_in_children(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    here = pe.finetune(**options, out=str(tmp_path / "here"), compile_in="process")
    assert here.auto_scheme is not None and not here.auto_scheme["cached"]
    shutil.rmtree(tmp_path / "cache")  # the child analyses afresh
    out = tmp_path / "child"
    seen = _finetune_in_a_fresh_process(
        tmp_path, {**options, "out": str(out), "compile_in": "child"}
    )
    # one child (the analysis, then the compile) and no torch here while it runs
    assert seen == {"torch_at_launch": [False], "torch_after": True}
    child = json.loads((out / "summary.json").read_text())
    auto = child["auto_scheme"]
    assert not auto["cached"] and auto["scheme"] == here.auto_scheme["scheme"]
    assert auto["candidates"] == json.loads(json.dumps(here.auto_scheme["candidates"]))
    _same_checkpoint(here.checkpoint, out / checkpoint.CHECKPOINT)
    assert child["test"] == here.test and child["trained_params"] == here.trained_params


def test_the_analysis_error_in_the_child_is_raised_here(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    out = tmp_path / "low"
    with pytest.raises(FinetuneError, match="below the planned peak of the bias scheme"):
        pe.finetune(**options, out=str(out), memory_budget=1.0, compile_in="child")
    assert not list(out.glob(".compiled-*"))  # the children's folder is gone


def test_a_helper_holds_a_few_batches_of_the_data() -> None:
    """``Task.holding`` / ``for_analysis``: the helper processes keep the batches they
    read (the first, and the last ones the estimate uses), with the whole training
    split's fingerprint and size, so the analysis' cache keys and its gradient batches
    are those of the whole task."""
    import numpy as np

    from pockengine.tasks.data import fingerprint
    from pockengine.tasks.recipes import Task

    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    y = np.arange(100) % 4
    task = Task("t", None, None, (x, y), (x[:20], y[:20]), ("a", "b", "c", "d"),
                test=(x[:5], y[:5]))  # type: ignore[arg-type]  # fmt: skip
    slim = task.for_analysis(8, 2)
    assert task.for_analysis(8, 2, val=4).val[0].shape == (4, 3)
    assert slim.train_size == 100 and slim.train_fingerprint() == fingerprint(x, y)
    np.testing.assert_array_equal(slim.train[0], np.concatenate([x[:8], x[-16:]]))
    np.testing.assert_array_equal(slim.train[1][-16:], y[-16:])
    assert [len(a) for a in slim.val] == [0, 0] and [len(a) for a in slim.test] == [0, 0]
    kept = task.holding(8, val=64)  # the compile child: a batch of each split
    assert len(kept.train[0]) == 8 and len(kept.val[0]) == 20 and kept.train_size == 100
    whole = task.holding(60, 50)  # overlapping: all of it, in order
    assert whole.train[0] is x and whole.train_fingerprint() == task.train_fingerprint()


def test_the_compile_reuses_the_analysis_import(
    tmp_path: Path, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the child, the compile of the chosen scheme takes the analysis' import of the
    run's batch (``import_memo``): one torch.export fewer than analysing and compiling
    apart."""
    import contextlib
    from collections.abc import Iterator

    from pockengine.finetune import FinetuneConfig
    from pockengine.finetune.compiling import compile_child
    from pockengine.frontend import import_memo
    from pockengine.tasks import recipe_table

    memos: list[import_memo.ImportMemo] = []
    real = import_memo.reused_imports

    @contextlib.contextmanager
    def spied() -> Iterator[import_memo.ImportMemo]:
        with real() as memo:
            memos.append(memo)
            yield memo

    monkeypatch.setattr(import_memo, "reused_imports", spied)
    config = FinetuneConfig(**options, recipe=None, out=str(tmp_path / "run")).validate()
    config = config.with_defaults(recipe_table.defaults(config)).validate()
    folder = tmp_path / "child"
    folder.mkdir()
    job = {"config": config.to_dict(), "scheme": None, "threads": None}
    (folder / compile_child.JOB).write_text(json.dumps(job))
    compile_child.compile_into(folder)
    assert len(memos) == 1 and memos[0].reused >= 1
    assert (folder / compile_child.CHOICE).exists() and (folder / compile_child.STEP_DIR).is_dir()


def test_a_missing_or_damaged_choice_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that exits without a readable ``choice.json`` is a ``FinetuneError`` naming
    the file, not a JSON traceback."""
    from pockengine.finetune import FinetuneConfig
    from pockengine.finetune.compiling import compile_child

    monkeypatch.setattr(compile_child, "run_child", lambda *args: None)
    config = FinetuneConfig(recipe="minilm-bbc")
    with pytest.raises(FinetuneError, match=r"choice\.json: the auto choice .* missing"):
        compile_child.compile_in_child(config, None, tmp_path)
    (tmp_path / compile_child.CHOICE).write_text("{not json")
    with pytest.raises(FinetuneError, match=r"choice\.json: the auto choice .* damaged"):
        compile_child.compile_in_child(config, None, tmp_path)


def test_the_work_before_the_first_step_is_said(
    tmp_path: Path, options: dict[str, Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """A run says on stderr what it does before its first step (the child's lines
    too, on the same clock), in order; ``--progress none`` says nothing."""
    pe.finetune(**{**options, "progress": "plain", "max_steps": 1}, out=str(tmp_path / "a"),
                compile_in="child")  # fmt: skip
    err = capfd.readouterr().err
    said = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[")]
    expected = ["compiling in a child process", "model and data ready: 72 training examples",
                "--scheme auto: choosing what to train", "--scheme auto: scoring",
                "--scheme auto: bias + ", "compiling the training step",
                "compiling the evaluation", "writing the compiled step"]  # fmt: skip
    starts = iter(said)
    assert all(any(s.startswith(e) for s in starts) for e in expected), said
    seconds = [float(line[1:].split(" s]")[0]) for line in err.splitlines() if line[:1] == "["]
    assert seconds == sorted(seconds)  # one clock, the run's

    pe.finetune(**{**options, "max_steps": 1}, out=str(tmp_path / "b"), compile_in="process")
    assert "[" not in capfd.readouterr().err  # progress none: nothing before the bar either
    pe.finetune(**{**options, "progress": "plain", "max_steps": 1}, out=str(tmp_path / "c"),
                compile_in="process")  # fmt: skip
    again = capfd.readouterr().err
    assert "--scheme auto: the choice made before" in again  # the cache, said so
    assert "compiling the training step and its evaluation" in again
