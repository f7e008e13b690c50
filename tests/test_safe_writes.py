"""Writes stay where they belong (issue 39, parts 2 and 4): no write follows a symbolic link
out of the folder it was given, an output folder is new, empty or ours of the same kind
(``--force`` replaces only our files), and a failed export leaves nothing behind. Each test
hashes the tree around the target before and after: nothing outside it changes, nothing
saved is lost."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pockengine import out_folder, safe_write
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from pockengine.finetune.run_folder.metrics_log import MetricsLog
from pockengine.finetune.running.run_lock import check_out_folder
from pockengine.finetune.trained.run_eval import CONFUSION_PNG, EVAL_JSON, write_eval
from pockengine.safe_write import UnsafeWriteError
from tests.test_export_cli import BAG
from tests.test_finetune_resume import write_task

MODULE = "safe_writes_bag"


def tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's SHA-256, a link's target, a folder's mark."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


def fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI in process: exit 2, one ``error:`` line, no traceback."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    return err


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny bag-of-words task (module ``safe_writes_bag``, ``reviews.csv``)."""
    folder = tmp_path_factory.mktemp("task")
    write_task(folder, rows=48, module=MODULE)
    (folder / f"{MODULE}.py").write_text(BAG)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def finetune_args(task: Path) -> list[str]:
    return ["finetune", "--model", f"{MODULE}:bag", "--data", str(task / "reviews.csv"),
            "--text-column", "review", "--label-column", "sentiment", "--seq-len", "12",
            "--batch-size", "8", "--epochs", "1", "--max-steps", "2", "--progress", "none",
            "--compile-in", "process"]  # fmt: skip


def export_args(task: Path) -> list[str]:
    return ["export", "--model", f"{MODULE}:bag", "--data", str(task / "reviews.csv"),
            "--text-column", "review", "--label-column", "sentiment", "--seq-len", "12",
            "--batch-size", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(task_dir: Path) -> Path:
    """A fine-tune run of two steps (tests copy it before changing anything)."""
    run = task_dir / "run"
    assert main([*finetune_args(task_dir), "--out", str(run)]) == 0
    return run


# -- the helper ------------------------------------------------------------------------


def test_a_planted_link_is_refused_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").symlink_to(outside / "victim.txt")
    (run / "sub").symlink_to(outside, target_is_directory=True)
    (run / "metrics.jsonl").symlink_to(outside / "victim.txt")
    before = tree(tmp_path)
    with pytest.raises(UnsafeWriteError, match=r"summary\.json: it is a symbolic link"):
        safe_write.write_json(run / "summary.json", {"a": 1})
    with pytest.raises(UnsafeWriteError, match=r"run/sub is a symbolic link"):
        safe_write.write_bytes(run / "sub" / "x.bin", b"data", inside=run)
    with pytest.raises(UnsafeWriteError, match=r"run/sub is a symbolic link"):
        safe_write.make_dirs(run / "sub" / "deeper", inside=run)
    with pytest.raises(UnsafeWriteError, match=r"metrics\.jsonl: it is a symbolic link"):
        MetricsLog(run / "metrics.jsonl").append({"step": 1})
    assert tree(tmp_path) == before


def test_a_planted_temporary_name_is_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".eval.json.guess.tmp").symlink_to(victim)
    monkeypatch.setattr(safe_write, "temporary_name", lambda name: f".{name}.guess.tmp")
    before = tree(tmp_path)
    with pytest.raises(UnsafeWriteError, match=r"eval\.json: its temporary file .* exists"):
        safe_write.write_json(run / "eval.json", {"accuracy": 1.0})
    assert tree(tmp_path) == before


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "report.txt"
    path.write_text("old")

    def fill(f: Any) -> None:
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        safe_write.write_with(path, fill)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.txt"]
    safe_write.write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.txt"]


def test_evaluate_does_not_write_through_a_planted_confusion_png(tmp_path: Path) -> None:
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"someone else's picture")
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFUSION_PNG).symlink_to(victim)
    result = {"labels": ["neg", "pos"], "confusion": [[3, 1], [0, 4]], "accuracy": 0.875,
              "macro_f1": 0.87}  # fmt: skip
    before = tree(tmp_path)
    with pytest.raises(UnsafeWriteError, match=r"confusion\.png: .*is a symbolic link"):
        write_eval(run, result)
    assert tree(tmp_path) == before  # refused before anything was written, eval.json included
    assert not (run / EVAL_JSON).exists()


def test_a_forced_folder_is_merged_file_by_file_and_links_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "out"
    (target / "model").mkdir(parents=True)
    (target / "model" / "weights.bin").write_bytes(b"the user's")
    (target / "model" / "config.json").write_text("old")
    built = tmp_path / ".out.new.tmp"
    (built / "model").mkdir(parents=True)
    (built / "model" / "config.json").write_text("new")
    (built / "report.txt").write_text("ours")
    out_folder.install_folder(built, target, merge=True)
    assert (target / "model" / "weights.bin").read_bytes() == b"the user's"
    assert (target / "model" / "config.json").read_text() == "new"
    assert (target / "report.txt").read_text() == "ours" and not built.exists()
    outside = tmp_path / "outside"
    outside.mkdir()
    (target / "kernels").symlink_to(outside, target_is_directory=True)
    (built / "kernels").mkdir(parents=True)
    (built / "kernels" / "ops.c").write_text("int x;")
    (built / "report.txt").write_text("newer")
    before = tree(tmp_path)
    with pytest.raises(UnsafeWriteError, match=r"out/kernels: it is a symbolic link"):
        out_folder.install_folder(built, target, merge=True)
    assert tree(tmp_path) == before  # refused before anything moved


# -- output folders ----------------------------------------------------------------------


def test_finetune_out_over_a_users_folder_is_refused_then_forced(
    tmp_path: Path, task_dir: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "weights.bin").write_bytes(b"\x01\x02weights")
    (mine / "report.txt").write_text("my report")
    (mine / "notes.txt").write_text("my notes")
    before = tree(tmp_path)
    monkeypatch.chdir(mine)
    err = fails([*finetune_args(task_dir), "--out", "."], capsys)
    assert "--out . is not empty and not a fine-tune run" in err
    assert "model/" in err and "report.txt" in err and "--force" in err
    assert tree(tmp_path) == before
    assert main([*finetune_args(task_dir), "--out", ".", "--force"]) == 0
    after = tree(tmp_path)
    kept = {k: v for k, v in before.items() if k != "mine/report.txt"}
    assert {k: after[k] for k in kept} == kept  # model/weights.bin, notes.txt as they were
    assert (mine / "report.txt").read_text() != "my report"  # a file a run writes
    assert (mine / "model" / "pockengine.json").is_file()
    assert not (mine / out_folder.MARKER).exists()  # a forced folder is not taken as a run


def test_export_o_over_a_users_folder_is_refused_then_forced(
    tmp_path: Path, task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("Makefile", "README.md", "step.c", "notes.txt"):
        (folder / name).write_text(f"the user's {name}\n")
    before = tree(tmp_path)
    err = fails([*export_args(task_dir), "--target", "c", "-o", str(folder)], capsys)
    assert f"-o {folder} is not empty and not an export of pockengine" in err
    assert "Makefile" in err and "--force" in err
    assert tree(tmp_path) == before
    assert main([*export_args(task_dir), "--target", "c", "-o", str(folder), "--force"]) == 0
    assert (folder / "notes.txt").read_text() == "the user's notes.txt\n"  # not ours: kept
    assert (folder / "step.c").read_text() != "the user's step.c\n"  # ours: replaced
    assert (folder / "kernels").is_dir() and (folder / "state.safetensors").is_file()
    assert not list(tmp_path.glob(".project.*"))  # the sibling it was built in is gone


def test_export_of_a_run_through_a_planted_export_c_is_refused(
    tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "export_c").symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path)
    err = fails(["export", str(run), "--target", "c"], capsys)
    assert "export_c is a symbolic link" in err
    assert tree(tmp_path) == before


def test_a_failed_export_leaves_nothing_and_keeps_the_old_one(
    tmp_path: Path, task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new"
    err = fails([*export_args(task_dir), "--target", "c", "-o", str(new),
                 "--write-batches", "100000"], capsys)  # fmt: skip
    assert "--write-batches 100000" in err
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    assert main([*export_args(task_dir), "--target", "onnx", "-o", str(old)]) == 0
    assert json.loads((old / out_folder.MARKER).read_text()) == {"kind": out_folder.EXPORT}
    before = tree(tmp_path)
    fails([*export_args(task_dir), "--target", "c", "-o", str(old),
           "--write-batches", "100000"], capsys)  # fmt: skip
    assert tree(tmp_path) == before  # an export of ours is replaced only by a complete one
    assert main([*export_args(task_dir), "--target", "c", "-o", str(old)]) == 0
    assert (old / "step.c").is_file() and not (old / "train_step.onnx").exists()


def test_federated_out_over_a_finetune_run_is_refused(
    tmp_path: Path, run_dir: Path, task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = tree(tmp_path)
    args = ["federated", "--model", f"{MODULE}:bag", "--data", str(task_dir / "reviews.csv"),
            "--text-column", "review", "--label-column", "sentiment",
            "--out", str(run)]  # fmt: skip
    err = fails(args, capsys)
    assert f"--out {run} is a fine-tune run folder of pockengine, not a federation" in err
    assert tree(tmp_path) == before


def test_a_run_from_before_the_marker_is_still_a_run(tmp_path: Path, run_dir: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / out_folder.MARKER).unlink()
    assert check_out_folder(run).ours
    (run / "holiday.jpg").write_bytes(b"not a run's")
    with pytest.raises(out_folder.OutFolderError, match=r"holiday\.jpg"):
        check_out_folder(run)
    assert (run / checkpoint.CHECKPOINT).is_file()


def test_deployment_logs_replace_the_earlier_ones_and_follow_no_link(tmp_path: Path) -> None:
    from pockengine.federated.deployment import LOGS, _keep_logs

    logs = tmp_path / "processes"
    logs.mkdir()
    (logs / "flwr-run.log").write_text("this run")
    out = tmp_path / "fed"
    (out / LOGS).mkdir(parents=True)
    (out / LOGS / "old.log").write_text("an earlier run")
    _keep_logs(logs, out / LOGS)
    assert tree(out / LOGS) == tree(logs)
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / LOGS).symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path)
    with pytest.raises(UnsafeWriteError, match=r"deployment-logs: it is a symbolic link"):
        _keep_logs(logs, linked / LOGS)
    assert tree(tmp_path) == before
