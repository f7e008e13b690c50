"""Fine-tuning for real: all-MiniLM-L6-v2 on BBC News (the default recipe), end to end
through the command line on a small subset, with the default (torch) backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pockengine import zoo
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint

# Measured: 0.85-0.86 validation accuracy after this run (128 training articles, 8 steps of
# head-only AdamW at 32 tokens). Chance is 0.20 for 5 topics; 0.6 leaves a wide margin.
MIN_ACCURACY = 0.6


def test_minilm_bbc_head_beats_chance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bbc"
    args = [
        "finetune",
        "--recipe",
        "minilm-bbc",
        "--scheme",
        "head",
        "--optimizer",
        "adamw",
        "--lr",
        "0.02",
        "--max-train",
        "128",
        "--max-val",
        "100",
        "--seq-len",
        "32",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--log-every",
        "4",
        "--progress",
        "plain",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["stopped"] is None
    assert summary["final"]["val_accuracy"] >= MIN_ACCURACY, summary["final"]
    assert "dropped 98 exact duplicate texts" in captured.out
    assert "validation accuracy" in captured.out and "peak RSS" in captured.out
    assert "full backprop" not in captured.out  # the report: report.txt, printed with --report
    assert "trained params" in (out / "report.txt").read_text()
    assert "ex/s" in captured.err and "ETA" in captured.err  # the plain progress line

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["train", "train", "eval", "summary"]
    assert rows[1]["loss"] < rows[0]["loss"]

    saved = checkpoint.load(out / checkpoint.CHECKPOINT)
    assert saved.counters == {"step": 8, "epoch": 1, "batch": 0, "examples": 128}
    assert saved.scheme == {"scheme": "head", "frozen_bn": "eval"}
    assert "rng.seed" in saved.optimizer
    assert saved.info["labels"] == ["business", "entertainment", "politics", "sports", "tech"]
    pretrained = load_file(str(zoo.minilm_path() / "model.safetensors"))
    name = "encoder.layer.5.output.dense.weight"
    assert set(saved.params) == {"head.weight", "head.bias"}  # frozen weights: the model's
    written = load_file(str(out / "model" / "model.safetensors"))  # RUN/model: all of them
    np.testing.assert_array_equal(written[name], pretrained[name])
    assert saved.params["head.weight"].shape == (5, 384)


def test_generic_hugging_face_folder_on_a_csv(tmp_path: Path) -> None:
    """The generic path with a local Hugging Face folder: AutoModel + AutoTokenizer,
    offline, a mean-pooled head; here the MiniLM folder on a small sentiment CSV."""
    import pockengine as pe
    from tests.test_finetune_resume import write_task

    task = write_task(tmp_path, module="unused_factory")
    task.update(model=str(zoo.minilm_path()), seq_len=16, max_train=32, epochs=1, scheme="head")
    result = pe.finetune(**task, out=str(tmp_path / "hf"))
    assert result.finished and result.steps == 4 and result.labels == ("neg", "pos")
    assert result.config.recipe is None and result.inputs == "16 tokens"
    assert 0 <= result.final["val_accuracy"] <= 1
    assert result.step.trained == ("head.weight", "head.bias")
