"""Kill and resume: a run stopped (by --max-steps, SIGKILL or SIGTERM) and resumed ends
with the same weights, optimizer state, dropout seed and metrics as one that never
stopped. A tiny bag-of-words model with dropout on a small CSV keeps it fast."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import pockengine as pe
from pockengine.finetune.cli import exit_code
from pockengine.finetune.run_folder import checkpoint
from pockengine.finetune.running import loop
from pockengine.finetune.running.progress import Progress

TINY_MODEL = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self, vocab_size: int, num_labels: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask.unsqueeze(-1).to(torch.float32)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(torch.float32)
        return self.head(self.drop(pooled))


def bag(vocab_size, num_labels):
    return Bag(vocab_size, num_labels)
"""

POSITIVE = ["good", "great", "excellent", "fine", "lovely", "nice", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "poor", "horrible", "nasty", "dull"]
FILLER = ["the", "a", "movie", "film", "plot", "was", "is", "it", "and", "very"]


def write_task(folder: Path, rows: int = 240, module: str = "tiny_bag") -> dict[str, Any]:
    """A factory module and a sentiment CSV in ``folder``; the finetune options using them."""
    (folder / f"{module}.py").write_text(TINY_MODEL)
    rng = np.random.default_rng(0)
    with (folder / "reviews.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        for i in range(rows):
            label = "pos" if i % 2 else "neg"
            words = [*rng.choice(FILLER, 6), *rng.choice(POSITIVE if i % 2 else NEGATIVE, 2)]
            writer.writerow([" ".join(rng.permutation(words)) + f" #{i}", label])
    return {
        "model": f"{module}:bag",
        "data": str(folder / "reviews.csv"),
        "text_column": "review",
        "label_column": "sentiment",
        "seq_len": 12,
        "batch_size": 8,
        "epochs": 3,
        "lr": 1e-2,
        "progress": "none",
    }


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    # Compiled in this process: where the step is compiled changes no bit of it, and a
    # child's imports would be most of each run's time. The CLI tests keep the default.
    return {**write_task(tmp_path), "compile_in": "process"}


def assert_same_state(a: Path, b: Path) -> None:
    x, y = checkpoint.load(a), checkpoint.load(b)
    assert x.counters == y.counters
    for got, want in ((x.params, y.params), (x.optimizer, y.optimizer)):
        assert got.keys() == want.keys()
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)
    assert "rng.seed" in x.optimizer  # the dropout seed is part of what resumes


def metric_lines(path: Path) -> list[dict[str, Any]]:
    """The metrics log without its timings (which differ between runs)."""
    timing = {"examples_per_s", "step_s", "elapsed_s", "wall_s", "compile_s"}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k not in timing} for r in rows if r["event"] != "summary"
    ]


def test_max_steps_then_resume_matches_uninterrupted(tmp_path: Path, task: dict[str, Any]) -> None:
    whole = pe.finetune(**task, out=str(tmp_path / "whole"))
    assert whole.finished and whole.steps == whole.total_steps == 72
    first = pe.finetune(**task, out=str(tmp_path / "split"), max_steps=29, checkpoint_every=7)
    assert first.stopped == "max_steps" and first.steps == 29
    rest = pe.finetune(**task, out=str(tmp_path / "split"), resume=True)
    assert rest.finished and rest.steps == 72
    assert_same_state(whole.checkpoint, rest.checkpoint)
    assert metric_lines(whole.metrics_path) == metric_lines(rest.metrics_path)
    assert rest.history == whole.history
    assert rest.final["val_accuracy"] > 0.8


def test_resume_refuses_changed_options(tmp_path: Path, task: dict[str, Any]) -> None:
    out = str(tmp_path / "run")
    pe.finetune(**task, out=out, max_steps=3)
    with pytest.raises(pe.FinetuneError, match=re.escape("lr: 0.01 in the checkpoint, 0.02 now")):
        pe.finetune(**{**task, "lr": 2e-2}, out=out, resume=True)
    with pytest.raises(pe.FinetuneError, match="already holds a checkpoint"):
        pe.finetune(**task, out=out)


def test_a_checkpoint_older_than_an_option_resumes_at_its_default(
    tmp_path: Path, task: dict[str, Any]
) -> None:
    """Options added after a checkpoint was written (here test_fraction, frozen_dtype and
    batchnorm, whose default is now the recipe's: "batch" then) count as their defaults;
    a changed option is still refused."""
    from pockengine.finetune.run_folder import checkpoint as ckpt_io

    out = tmp_path / "run"
    pe.finetune(**task, out=str(out), max_steps=3)
    saved = ckpt_io.load(out / ckpt_io.CHECKPOINT)
    assert saved.config["batchnorm"] == "batch"
    for newer in ("test_fraction", "frozen_dtype", "batchnorm"):
        saved.config.pop(newer)
    ckpt_io.save(out / ckpt_io.CHECKPOINT, saved)
    with pytest.raises(
        pe.FinetuneError, match=re.escape("test_fraction: 0.0 in the checkpoint, 0.5")
    ):
        pe.finetune(**task, out=str(out), resume=True, test_fraction=0.5)
    with pytest.raises(pe.FinetuneError, match=re.escape("batchnorm: 'batch' in the checkpoint")):
        pe.finetune(**task, out=str(out), resume=True, batchnorm="running")
    rest = pe.finetune(**task, out=str(out), resume=True, max_steps=5)
    assert rest.steps == 5


def _resumed_without(
    tmp_path: Path, task: dict[str, Any], option: str, started: str, other: str
) -> Any:
    """A run started with ``option=started``, resumed without the option (the run's own
    comes from the checkpoint's header) after a resume with ``option=other`` is refused."""
    out = tmp_path / "run"
    pe.finetune(**task, out=str(out), **{option: started}, max_steps=3)
    assert checkpoint.saved_options(out / checkpoint.CHECKPOINT)[option] == started
    with pytest.raises(
        pe.FinetuneError, match=re.escape(f"{option}: {started!r} in the checkpoint")
    ):
        pe.finetune(**task, out=str(out), resume=True, **{option: other}, max_steps=5)
    rest = pe.finetune(**task, out=str(out), resume=True, max_steps=5)
    assert rest.steps == 5
    return rest


def test_resume_without_batchnorm_trains_the_runs_own(tmp_path: Path, task: dict[str, Any]) -> None:
    """A run started with --batchnorm running resumes without the option as it was (the
    recipe's default may differ); a given --batchnorm that differs is refused."""
    rest = _resumed_without(tmp_path, task, "batchnorm", "running", "batch")
    assert checkpoint.saved_options(rest.checkpoint)["batchnorm"] == "running"


def test_resume_without_scheme_trains_the_runs_own(tmp_path: Path, task: dict[str, Any]) -> None:
    """A run started under another scheme than today's default (the factory model's is
    full) resumes without --scheme as it was: the scheme comes from the checkpoint's
    header; a given --scheme that differs is still refused."""
    rest = _resumed_without(tmp_path, task, "scheme", "head", "full")
    assert set(checkpoint.load(rest.checkpoint).params) == {"head.weight", "head.bias"}


def test_saved_options_of_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.saved_options(tmp_path / "missing.safetensors") is None
    for data in (b"", b"\xff" * 8 + b"{}", (2).to_bytes(8, "little") + b"{}", b"garbage!{}"):
        (tmp_path / "bad.safetensors").write_bytes(data)
        assert checkpoint.saved_options(tmp_path / "bad.safetensors") is None


def test_checkpoint_holds_only_what_training_changes(tmp_path: Path, task: dict[str, Any]) -> None:
    """A head-only run's checkpoint holds the head, not the frozen embedding (the model's
    own, loaded again on resume); one holding every param (as older ones did) still
    resumes to the same state, and one lacking a trained value is refused."""
    sparse = {**task, "scheme": "head", "epochs": 1}
    whole = pe.finetune(**sparse, out=str(tmp_path / "whole"))
    out = tmp_path / "run"
    pe.finetune(**sparse, out=str(out), max_steps=4)
    path = out / checkpoint.CHECKPOINT
    saved = checkpoint.load(path)
    assert set(saved.params) == {"head.weight", "head.bias"}
    frozen = load_file(str(out / "model" / "model.safetensors"))["emb.weight"]
    complete = {**saved.params, "emb.weight": frozen}  # as checkpoints before session 7
    saved.params.pop("head.bias")
    checkpoint.save(path, saved)
    with pytest.raises(pe.FinetuneError, match=r"1 missing \(head\.bias\)"):
        pe.finetune(**sparse, out=str(out), resume=True)
    saved.params = complete
    checkpoint.save(path, saved)
    rest = pe.finetune(**sparse, out=str(out), resume=True)
    assert rest.finished
    assert_same_state(whole.checkpoint, rest.checkpoint)


def _cli(task: dict[str, Any], out: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "pockengine", "finetune"]
    for key, value in task.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return [*args, "--out", str(out), *extra]


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(cwd), str(Path(__file__).resolve().parents[1])]),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_sigkilled_process_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed with SIGKILL right after a checkpoint, then run again with --resume,
    ends where an uninterrupted run (here, in this process) ends."""
    monkeypatch.syspath_prepend(str(tmp_path))
    task = write_task(tmp_path, rows=500, module="tiny_bag_cli")
    task.update(batch_size=4, epochs=2, checkpoint_every=25)  # 200 steps
    killed = tmp_path / "killed"
    proc = _start(_cli(task, killed), tmp_path)
    # meanwhile, on the other core: compiled here, so that it ends before the killed run's
    # checkpoint (which compiles in a child first) on a loaded machine
    whole = pe.finetune(**task, out=str(tmp_path / "whole"), compile_in="process")
    deadline = time.monotonic() + 120
    while not (killed / checkpoint.CHECKPOINT).exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{err}"
    assert 0 < checkpoint.load(killed / checkpoint.CHECKPOINT).counters["step"] < 200
    resumed = _start(_cli(task, killed, "--resume"), tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"files in {killed}:" in out  # the closing screen
    assert_same_state(whole.checkpoint, killed / checkpoint.CHECKPOINT)
    assert metric_lines(whole.metrics_path) == metric_lines(killed / "metrics.jsonl")
    assert not list(killed.glob(".*.tmp"))


class _SignalAt(Progress):
    """A silent progress bar that sends this process ``sig`` after step ``at``."""

    def __init__(self, at: int, sig: int, total: int, done: int, batch_size: int) -> None:
        super().__init__(total, done, batch_size)
        self.at, self.sig = at, sig

    def update(self, loss: float, lr: float, epoch: int) -> None:
        super().update(loss, lr, epoch)
        if self.done == self.at:
            os.kill(os.getpid(), self.sig)


# SIGINT takes the same path as SIGTERM (one handler for both); its run is slow-marked.
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_signal_stops_with_checkpoint_and_resumes(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch, sig: int
) -> None:
    # Whatever handlers the process started with (SIGINT may be ignored, as under nohup and
    # some CI runners) are what every run must leave behind.
    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    whole = pe.finetune(**task, out=str(tmp_path / "whole"))

    def signal_at_17(mode: str, total: int, done: int, batch_size: int) -> Progress:
        return _SignalAt(17, sig, total, done, batch_size)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "make_progress", signal_at_17)
        first = pe.finetune(**{**task, "compile_in": "child"}, out=str(tmp_path / "stopped"))
    assert first.stopped == signal.Signals(sig).name and first.steps == 17
    assert exit_code(first.stopped) == 128 + sig
    rest = pe.finetune(**task, out=str(tmp_path / "stopped"), resume=True)
    assert_same_state(whole.checkpoint, rest.checkpoint)
    assert {s: signal.getsignal(s) for s in found} == found
