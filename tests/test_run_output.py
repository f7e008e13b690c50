"""What a fine-tuning run leaves for a person: curves.png redrawn as it goes, the
compile-time report in report.txt (printed only with --report), one closing screen, and
``pockengine plot`` overlaying runs. Real runs of a tiny factory model on a small CSV."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine.cli import main
from pockengine.finetune.running import curves
from pockengine.finetune.running.result import best_row
from tests.test_finetune_resume import write_task

pytestmark = pytest.mark.curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _args(task: dict[str, Any], out: Path, *extra: str) -> list[str]:
    args = ["finetune"]
    for key, value in task.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return [*args, "--epochs", "2", "--log-every", "4", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two runs of one task (full backprop, printed with --report; the head only,
    printed without) and what each printed."""
    folder = tmp_path_factory.mktemp("runs")
    sys.path.insert(0, str(folder))
    try:
        task = write_task(folder, rows=120, module="tiny_bag_output")
        printed = {}
        for name, extra in (("full", ["--report"]), ("head", ["--scheme", "head"])):
            stdout = io.StringIO()  # capsys is per test; these runs are the module's
            with contextlib.redirect_stdout(stdout):
                assert main(_args(task, folder / name, *extra)) == 0
            printed[name] = stdout.getvalue()
    finally:
        sys.path.remove(str(folder))
    return {"folder": folder, "printed": printed}


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    pixels = matplotlib.image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # something is drawn


def test_curves_png_is_a_real_image_of_the_run(runs: dict[str, Any]) -> None:
    run = runs["folder"] / "full"
    assert_png(run / "curves.png")
    drawn = curves.read_curves(run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert drawn.loss_steps == [r["step"] for r in rows if r["event"] == "train"]
    assert drawn.val_values == [r["val_accuracy"] for r in rows if r["event"] == "eval"]
    assert drawn.metric == "val_accuracy" and len(drawn.val_values) == 2
    summary = json.loads((run / "summary.json").read_text())
    assert drawn.info.trained_params == summary["trained_params"] > 0
    assert drawn.info.peak_rss_bytes == summary["peak_rss_bytes"] > 0
    assert f"{summary['trained_params']:,} trained params" in drawn.info.label()
    assert not list(run.glob(".*.tmp"))  # written atomically


def test_report_goes_to_report_txt_and_prints_only_with_report(runs: dict[str, Any]) -> None:
    for name in ("full", "head"):
        text = (runs["folder"] / name / "report.txt").read_text()
        assert text.startswith("compile-time report") and "planned peak" in text
    assert "compile-time report" in runs["printed"]["full"]  # --report
    assert "compile-time report (scheme" not in runs["printed"]["head"]
    assert "full backprop" not in runs["printed"]["head"]


def test_report_keeps_full_layer_names() -> None:
    long_name = "a_module_whose_name_is_much_longer_than_forty_characters"
    model = nn.Sequential()
    model.add_module(long_name, nn.Linear(4, 3))
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    step = pe.compile(model, lambda m, a, b: nn.functional.cross_entropy(m(a), b), (x, y))
    rows = [line.split() for line in str(step.report()).splitlines()]
    assert [long_name, "15"] in [row[:2] for row in rows]  # the full name; 4 x 3 + 3 trained


def test_the_closing_screen_holds_the_metrics_and_the_files(runs: dict[str, Any]) -> None:
    run = runs["folder"] / "head"
    screen = runs["printed"]["head"]
    summary = json.loads((run / "summary.json").read_text())
    final, best = summary["final"], summary["best"]
    assert f"final {final['val_accuracy']:.4f} (epoch 2)" in screen
    assert f"best {best['val_accuracy']:.4f} (epoch {best['epoch']})" in screen
    assert f"peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB" in screen
    assert f"planned peak of the step {summary['planned_peak_bytes'] / 2**20:.1f} MiB" in screen
    assert re.search(r"\d+\.\d examples/s", screen)
    assert f"scheme head: {summary['trained_params']:,} of {summary['total_params']:,}" in screen
    listed = screen.split(f"files in {run}:")[1]
    for name in ("checkpoint.safetensors", "metrics.jsonl", "summary.json", "report.txt",
                 "curves.png"):  # fmt: skip
        assert (run / name).exists() and name in listed
    assert len(screen.splitlines()) <= 25  # one screen


def test_plot_overlays_two_runs(runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    folder = runs["folder"]
    out = folder / "both.png"
    assert main(["plot", str(folder / "full"), str(folder / "head"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert_png(out)
    assert out.read_bytes() != (folder / "full" / "curves.png").read_bytes()
    labels = [curves.read_curves(folder / n).info.label() for n in ("full", "head")]
    assert "scheme full" in labels[0] and "scheme head" in labels[1]


def test_plot_of_a_folder_that_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no metrics.jsonl" in err and "Traceback" not in err


def test_without_matplotlib_the_picture_is_skipped_with_one_line(
    runs: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The run's drawing child, whose matplotlib fails to import (a stand-in package first
    on its path), writes nothing; the run hears of it once, and nothing raises."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["folder"] / "head" / "metrics.jsonl", run)
    writer = curves.CurvesWriter(run)
    curves._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="pockengine.finetune.running.curves"):
        for _ in range(2):  # two validations
            writer.update(curves.RunInfo("run", "head"))
        assert writer.wait() is None
    assert not list(run.glob("*.png")) and not list(run.glob(".*.tmp"))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "matplotlib is missing" in warned[0]
    monkeypatch.delenv("PYTHONPATH")
    writer.update(curves.RunInfo("run", "head"))  # with matplotlib: drawn
    assert writer.wait() == run / "curves.png"
    assert_png(run / "curves.png")


def test_ema_is_debiased_and_follows_the_values() -> None:
    assert curves.ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    smooth = curves.ema([1.0, 0.0, 0.0, 0.0], weight=0.5)
    assert smooth[0] == 1.0 and smooth == sorted(smooth, reverse=True) and smooth[-1] > 0


def test_best_row_by_metric_ties_to_the_latest() -> None:
    rows = [{"epoch": 1, "val_accuracy": 0.9}, {"epoch": 2, "val_accuracy": 0.9},
            {"epoch": 3, "val_accuracy": 0.8}]  # fmt: skip
    assert best_row(rows)["epoch"] == 2
    lm = [{"epoch": 1, "val_perplexity": 20.0, "val_loss": 3.0},
          {"epoch": 2, "val_perplexity": 25.0, "val_loss": 3.2}]  # fmt: skip
    assert best_row(lm)["epoch"] == 1 and best_row([]) == {}
