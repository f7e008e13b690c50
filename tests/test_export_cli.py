"""``pockengine export`` for the fine-tune a user ran: from ``--model/--data`` and from a run
folder, for both targets. The exported artifact runs the command its README.txt gives on
the batches it wrote, and its losses are those of ``pe.compile`` in process on the same
batches; a run's export holds the run's checkpoint. A tiny bag-of-words model (no dropout:
the C trainer has no random mask) on a small CSV keeps each test to seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.backends.c.export import read_trainer_state
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from pockengine.out_folder import MARKER
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.data import epoch_order
from tests.cached_cc import make_trainer
from tests.test_finetune_resume import write_task

BAG = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask.unsqueeze(-1).to(torch.float32)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(torch.float32)
        return self.head(pooled)


def bag(vocab_size, num_labels):
    return Bag(vocab_size, num_labels)
"""


@pytest.fixture
def options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The finetune options of the tiny task (module ``export_bag``, data ``reviews.csv``)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    task = write_task(tmp_path, module="export_bag")
    (tmp_path / "export_bag.py").write_text(BAG)
    return ["--model", "export_bag:bag", "--data", task["data"], "--text-column", "review",
            "--label-column", "sentiment", "--seq-len", "12", "--batch-size", "8",
            "--lr", "0.01"]  # fmt: skip


def _task(data: str) -> recipes.Task:
    """The tiny task as ``pockengine finetune`` builds it from the options above."""
    config = FinetuneConfig(
        recipe=None, model="export_bag:bag", data=data, seq_len=12,
        text_column="review", label_column="sentiment", batch_size=8,
    )  # fmt: skip
    config = config.with_defaults(recipes.defaults(config))
    return recipes.build(config)


def _reference_losses(data: str, batches: list[tuple[np.ndarray, ...]]) -> list[float]:
    """``pe.compile`` of the same model (same seed, so the same initial weights) and
    optimizer, trained in process on ``batches``."""
    task = _task(data)
    example = tuple(torch.from_numpy(a) for a in batches[0])
    step = pe.compile(task.model, task.loss_fn, example,
                      optimizer=pe.optim.AdamW(lr=0.01, weight_decay=0.01))  # fmt: skip
    return [step(*b) for b in batches]


def _command(readme: str) -> str:
    """The command under "Run it:" in README.txt."""
    lines = readme.splitlines()
    return lines[lines.index("Run it:") + 1].strip()


def _losses(stdout: str) -> list[float]:
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]


def _run_readme(folder: Path, verbatim: bool = False) -> list[float]:
    """The losses of the README's command; a C trainer's ``make`` shares its kernels'
    objects with the other builds (tests/cached_cc.py) unless ``verbatim``."""
    command = _command((folder / "README.txt").read_text())
    command = command.replace("python ", f"{sys.executable} ", 1).replace("[--steps N] ", "")
    if not verbatim and command.startswith("make && "):
        make_trainer(folder)
        command = command.removeprefix("make && ")
    run = subprocess.run(command, shell=True, cwd=folder, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return _losses(run.stdout)


def test_export_c_from_model_and_data(tmp_path: Path, options: list[str]) -> None:
    folder = tmp_path / "c"
    args = ["export", *options, "--target", "c", "-o", str(folder), "--write-batches", "3"]
    assert main(args) == 0
    readme = (folder / "README.txt").read_text()
    assert "batch.0      int64    shape [8, 12]" in readme and "(label ids" in readme
    files = [folder / "batches" / f"batch.{i}.npy" for i in range(3)]
    stacked = [np.load(f) for f in files]
    assert [a.shape for a in stacked] == [(3, 8, 12), (3, 8, 12), (3, 8)]
    train = _task(str(tmp_path / "reviews.csv")).train
    rows = epoch_order(len(train[0]), 0, 0)[:24]  # the first batches a run (seed 0) takes
    for got, array in zip(stacked, train, strict=True):
        np.testing.assert_array_equal(got.reshape(24, *got.shape[2:]), array[rows])
    batches = [tuple(a[k] for a in stacked) for k in range(3)]
    want = _reference_losses(str(tmp_path / "reviews.csv"), batches)
    np.testing.assert_allclose(_run_readme(folder, verbatim=True), want, rtol=1e-5)


def test_export_onnx_from_model_and_data(tmp_path: Path, options: list[str]) -> None:
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "onnx"
    assert main(["export", *options, "-o", str(folder), "--write-batches", "2"]) == 0
    assert {p.name for p in folder.iterdir() if p.name != MARKER} == {
        "train_step.onnx", "train_step.state.npz", "ort_runner.py", "README.txt", "batches.npz"
    }  # fmt: skip
    with np.load(folder / "batches.npz") as data:
        assert data.files == ["batch.0", "batch.1", "batch.2"]
        batches = [tuple(data[n][k] for n in data.files) for k in range(2)]
    want = _reference_losses(str(tmp_path / "reviews.csv"), batches)
    np.testing.assert_allclose(_run_readme(folder), want, rtol=1e-5)


def test_export_of_a_run_holds_its_checkpoint(tmp_path: Path, options: list[str]) -> None:
    run = tmp_path / "run"
    trained = ["finetune", *options, "--max-steps", "2", "--progress", "none", "--out", str(run)]
    assert main(trained) == 0
    export = ["export", str(run), "--factory", "export_bag:bag"]
    assert main([*export, "--target", "c", "--write-batches", "1"]) == 0
    folder = run / "export_c"
    saved = checkpoint.load(run / checkpoint.CHECKPOINT)
    state = read_trainer_state(folder)
    for name, value in {**saved.params, **saved.optimizer}.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert "at step 2" in (folder / "README.txt").read_text()
    assert len(_run_readme(folder)) == 1
    pytest.importorskip("onnxruntime")
    from pockengine.ort_runner import TrainingSession

    assert main([*export, "-o", str(tmp_path / "onnx")]) == 0
    weights = TrainingSession(str(tmp_path / "onnx" / "train_step.onnx")).state_dict()
    assert weights.keys() == saved.params.keys()
    for name, value in saved.params.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _error(["export", str(empty)], capsys)
    assert "is not a fine-tuning run folder" in err and "checkpoint.safetensors" in err
    run = tmp_path / "run"
    run.mkdir()
    (run / checkpoint.CHECKPOINT).write_bytes(b"")
    err = _error(["export", str(run), "--scheme", "head", "--lr", "0.1"], capsys)
    assert "--lr, --scheme" in err and "a run folder brings its own" in err
    err = _error(["export", "mlp", "--batch-size", "4"], capsys)
    assert "--batch-size" in err and "not to mlp" in err
    err = _error(["export", "--model", "m:f", "--data", "d.csv", "--loss", "mse"], capsys)
    assert "--loss" in err and "not a fine-tune" in err
    err = _error(["export", "--target", "c"], capsys)
    assert "export what?" in err


def _exported_state(folder: Path, target: str) -> dict[str, np.ndarray]:
    if target == "c":
        return read_trainer_state(folder)
    return dict(pe.load_step(folder).flat_state_dict())


@pytest.mark.parametrize(("scheme", "target"), [("head", "c"), ("sparse", "step")])
def test_export_of_a_run_that_trained_some_params(
    tmp_path: Path, options: list[str], scheme: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint holds only the trained values; the export puts them over the rebuilt
    model's initial ones. Neither the C nor the step target needs onnxruntime."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    run = tmp_path / "run"
    trained = ["finetune", *options, "--scheme", scheme, "--max-steps", "2", "--progress",
               "none", "--compile-in", "process", "--out", str(run)]  # fmt: skip
    assert main(trained) == 0
    saved = checkpoint.load(run / checkpoint.CHECKPOINT)
    model = _task(str(tmp_path / "reviews.csv")).model  # the same seed: the initial values
    initial = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(saved.params) < set(initial)  # some params were not trained
    assert main(["export", str(run), "--factory", "export_bag:bag", "--target", target]) == 0
    folder = run / f"export_{target}"
    state = _exported_state(folder, target)
    for name, value in initial.items():
        np.testing.assert_array_equal(state[name], saved.params.get(name, value), err_msg=name)
    names = {p.name for p in folder.iterdir()}
    assert "README.txt" in names and "README.md" not in names


def test_export_c_takes_the_finetune_options_that_change_the_step(
    tmp_path: Path, options: list[str]
) -> None:
    """--frozen-dtype int8 (with --scheme head, so the embedding is frozen) reaches the C
    step: the exported state holds the embedding as int8 codes, and ./train gives the
    losses of pe.compile with the same options in process."""
    folder = tmp_path / "c"
    args = ["export", *options, "--scheme", "head", "--frozen-dtype", "int8",
            "--target", "c", "-o", str(folder), "--write-batches", "2"]  # fmt: skip
    assert main(args) == 0
    state = read_trainer_state(folder)
    codes = [name for name, a in state.items() if a.dtype == np.int8]
    assert codes and all(name.startswith("emb.weight") for name in codes)
    assert "emb.weight" not in state
    stacked = [np.load(folder / "batches" / f"batch.{i}.npy") for i in range(3)]
    batches = [tuple(a[k] for a in stacked) for k in range(2)]
    task = _task(str(tmp_path / "reviews.csv"))
    example = tuple(torch.from_numpy(a) for a in batches[0])
    step = pe.compile(task.model, task.loss_fn, example, scheme=pe.schemes.head(),
                      optimizer=pe.optim.AdamW(lr=0.01, weight_decay=0.01),
                      frozen_dtype="int8")  # fmt: skip
    want = [step(*b) for b in batches]
    np.testing.assert_allclose(_run_readme(folder), want, rtol=1e-5)


def test_readme_of_a_causal_lm_says_how_to_make_batches_from_text() -> None:
    from types import SimpleNamespace

    from pockengine.export_cli import _Prepared, readme
    from pockengine.ir import DType, GraphBuilder, Role, TensorType

    b = GraphBuilder("lm")
    ids = b.input("input_ids", TensorType((4, 128), DType.I64), Role.INPUT)
    graph = b.build([b.call("cast", ids, dtype=DType.F32, source="t")])
    step = SimpleNamespace(graph=graph)
    lm = readme(_Prepared(step, "an LM", kind="causal-lm"), "c", [])
    assert "reshape(-1, 4, 128)" in lm and "np.save('batches/input_ids.npy', ids)" in lm
    assert "rows of 128 tokens" in lm
    assert "your own text" not in readme(_Prepared(step, "a classifier"), "c", [])


def test_export_c_of_a_quantized_run_keeps_its_codes_and_checkpoint(
    tmp_path: Path, options: list[str]
) -> None:
    """A run with --frozen-dtype int8 exports as the low-bit C step it trained: the frozen
    embedding as int8 codes, the checkpoint's trained head, and ./train runs."""
    run = tmp_path / "run"
    trained = ["finetune", *options, "--scheme", "head", "--frozen-dtype", "int8",
               "--max-steps", "2", "--progress", "none", "--compile-in", "process",
               "--out", str(run)]  # fmt: skip
    assert main(trained) == 0
    export = ["export", str(run), "--factory", "export_bag:bag", "--target", "c"]
    assert main([*export, "--write-batches", "1"]) == 0
    state = read_trainer_state(run / "export_c")
    assert state["emb.weight.codes"].dtype == np.int8 and "emb.weight" not in state
    saved = checkpoint.load(run / checkpoint.CHECKPOINT)
    assert saved.params
    for name, value in saved.params.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert len(_run_readme(run / "export_c")) == 1
