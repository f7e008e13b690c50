"""Every read of a file of ours names the file: ``summary.json`` and ``metrics.jsonl``
(``pockengine plot``, a resumed run's log) and a GGUF file of frozen weights, each
truncated, of the wrong JSON kind or holding a value of the wrong type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pockengine.cli import main
from pockengine.finetune.run_folder.metrics_log import MetricsLog
from pockengine.finetune.run_folder.run_files import RunFileError
from pockengine.tasks.config import FinetuneError

ROWS = [
    {"event": "train", "step": 1, "epoch": 1, "loss": 0.9, "lr": 0.01},
    {"event": "train", "step": 2, "epoch": 1, "loss": 0.7, "lr": 0.01},
    {"event": "eval", "step": 2, "epoch": 1, "val_loss": 0.6, "val_accuracy": 0.75},
]


def _run(folder: Path, summary: str | None = None, rows: list[str] | None = None) -> Path:
    folder.mkdir()
    lines = rows if rows is not None else [json.dumps(r) for r in ROWS]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (folder / "summary.json").write_text(summary)
    return folder


def _plot_error(run: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["plot", str(run), "--out", str(run / "out.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (run / "out.png").exists()
    return err


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"config": {"scheme": "head"}, "trained_params": 12', "is not a readable run summary"),
        ('{"config": "head"}', "'config' is 'head'; expected a JSON object"),
        ('{"trained_params": "many"}', "'trained_params' is 'many'"),
    ],
)
def test_a_broken_summary_names_the_file(
    tmp_path: Path, summary: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run", summary)
    err = _plot_error(run, capsys)
    assert str(run / "summary.json") in err and message in err


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"event": "train", "step": "abc", "loss": 0.5}', ":2: 'step' is 'abc'"),
        ('{"event": "train", "step": 3, "loss": "low"}', ":2: 'loss' is 'low'; expected a number"),
        ('{"event": "eval", "step": 3, "val_accuracy": [1]}', ":2: 'val_accuracy' is [1]"),
    ],
)
def test_a_broken_metrics_line_names_the_file_and_line(
    tmp_path: Path, row: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run", rows=[json.dumps(ROWS[0]), row])
    err = _plot_error(run, capsys)
    assert f"{run / 'metrics.jsonl'}{message}" in err
    with pytest.raises(RunFileError, match=r"metrics\.jsonl:2"):
        MetricsLog(run / "metrics.jsonl").truncate_after(1)  # what --resume does


def test_metrics_that_are_not_text_name_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"event": "train", "step": 1, "loss": 0.5}\n\xff\xfe\n')
    err = _plot_error(run, capsys)
    assert f"{run / 'metrics.jsonl'} is not a readable metrics file" in err


def test_a_half_written_last_line_is_still_skipped(tmp_path: Path) -> None:
    """A killed run leaves its last line half written: the rows before it are read."""
    rows = [json.dumps(r) for r in ROWS]
    run = _run(tmp_path / "run", rows=[*rows, rows[0][:12]])
    assert MetricsLog(run / "metrics.jsonl").rows() == ROWS


def _gguf(path: Path) -> bytes:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_uint32("llama.attention.head_count_kv", 2)
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(weight, kind)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_a_truncated_or_corrupt_gguf_names_the_file(tmp_path: Path) -> None:
    from pockengine.tasks.gguf import llama_weights

    whole = _gguf(tmp_path / "model.gguf")
    assert set(llama_weights(tmp_path / "model.gguf")) == {"model.layers.0.self_attn.q_proj.weight"}
    corrupt = bytearray(whole)
    corrupt[40:48] = b"\xff" * 8  # inside the first key's name
    broken = tmp_path / "broken.gguf"
    for data in (whole[:-100], whole[:100], whole[:20], bytes(corrupt)):
        broken.write_bytes(data)
        with pytest.raises(FinetuneError) as caught:
            llama_weights(broken)
        assert str(broken) in str(caught.value) and "not a readable GGUF file" in str(caught.value)
