"""``pockengine finetune --compile-in child``: the model is imported and compiled in a child
process, which writes the step artifact; this process trains it.

- a run trains bit-identically to one compiled in-process (checkpoint, metrics log,
  validation history) and writes the same ``RUN/model`` (tensors, config files), and its
  process has not imported torch when it launches the child; a stopped run resumes through
  the child route to the uninterrupted run's state;
- the child's error (a scheme matching nothing) is raised here as the class it was, and
  the compile folder is removed; a task whose evaluation does not compile (it runs
  eagerly, on the model) is compiled here instead;
- ``model_skeleton.refill`` keeps a tensor the step does not hold and refuses a value of
  another shape.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import pockengine as pe
from pockengine.finetune import FinetuneConfig
from pockengine.finetune.compiling.model_skeleton import refill
from pockengine.finetune.run_folder import checkpoint
from pockengine.ir import SchemeError
from pockengine.safetensors_io import write_safetensors_to
from tests.test_finetune_resume import metric_lines, write_task

_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    return {**write_task(tmp_path, rows=64, module="child_bag"), "epochs": 1}


def _same_checkpoint(a: Path, b: Path) -> None:
    x, y = checkpoint.load(a), checkpoint.load(b)
    assert x.counters == y.counters
    for got, want in ((x.params, y.params), (x.optimizer, y.optimizer)):
        assert got.keys() == want.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _same_model(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        if name.endswith(".safetensors"):
            x, y = load_file(str(a / name)), load_file(str(b / name))
            assert x.keys() == y.keys()
            for key in x:
                np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    meta = [json.loads((f / "pockengine.json").read_text()) for f in (a, b)]
    for m in meta:
        m["config"] = {k: v for k, v in m["config"].items() if k not in ("out", "compile_in")}
    assert meta[0] == meta[1]


# Runs pe.finetune in a fresh interpreter (this one has torch loaded) and records, as the
# compile child is launched, whether the parent had imported torch.
_SPY = """
import json, subprocess, sys
launched = []
real_run = subprocess.run

def spy(*args, **kwargs):
    launched.append("torch" in sys.modules)
    return real_run(*args, **kwargs)

subprocess.run = spy
import pockengine as pe
pe.finetune(**json.loads(sys.argv[1]))
print(json.dumps({"torch_at_launch": launched, "torch_after": "torch" in sys.modules}))
"""


def _finetune_in_a_fresh_process(tmp_path: Path, options: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(_ROOT)])}
    done = subprocess.run([sys.executable, "-c", _SPY, json.dumps(options)], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return seen


def test_a_child_compiled_run_trains_as_an_in_process_one(
    tmp_path: Path, task: dict[str, Any]
) -> None:
    here = pe.finetune(**task, out=str(tmp_path / "here"), test_fraction=0.5,
                       compile_in="process")  # fmt: skip
    out = tmp_path / "child"
    seen = _finetune_in_a_fresh_process(
        tmp_path, {**task, "out": str(out), "test_fraction": 0.5, "compile_in": "child"}
    )
    # the parent holds no torch while the child compiles, and loads it to train
    assert seen == {"torch_at_launch": [False], "torch_after": True}
    child = json.loads((out / "summary.json").read_text())
    assert child["stopped"] is None and child["steps"] == here.steps
    _same_checkpoint(here.checkpoint, out / checkpoint.CHECKPOINT)
    assert metric_lines(here.metrics_path) == metric_lines(out / "metrics.jsonl")
    assert child["history"] == json.loads(json.dumps(here.history))
    assert child["test"] == here.test and child["trained_params"] == here.trained_params
    assert (out / "report.txt").read_text() == here.report_path.read_text()
    _same_model(tmp_path / "here" / "model", out / "model")
    assert not list(out.glob(".compiled-*"))  # the compile folder is gone
    texts = ["great fun", "dull and boring"]
    runs = [pe.load_run(tmp_path / r, factory=task["model"]) for r in ("here", "child")]
    probs = [r.predict_proba(texts) for r in runs]
    np.testing.assert_array_equal(probs[0], probs[1])


@pytest.mark.slow
def test_a_child_compiled_run_resumes(tmp_path: Path, task: dict[str, Any]) -> None:
    whole = pe.finetune(**task, out=str(tmp_path / "whole"))
    split = str(tmp_path / "split")
    first = pe.finetune(**task, out=split, max_steps=3, checkpoint_every=2, compile_in="child")
    assert first.stopped == "max_steps"
    rest = pe.finetune(**task, out=split, resume=True, compile_in="child")
    assert rest.finished
    _same_checkpoint(whole.checkpoint, rest.checkpoint)
    assert rest.history == whole.history


def test_the_childs_error_is_raised_here(tmp_path: Path, task: dict[str, Any]) -> None:
    scheme = tmp_path / "bad.json"
    scheme.write_text(json.dumps({"scheme": "select", "train": ["nothing.*"]}))
    with pytest.raises(SchemeError, match=r"train pattern 'nothing\.\*' matches no parameter"):
        pe.finetune(**task, out=str(tmp_path / "run"), scheme=str(scheme), compile_in="child")
    assert not list((tmp_path / "run").glob(".compiled-*"))


_EAGER_EVAL = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self, vocab_size: int, num_labels: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, num_labels)

    def forward(self, ids, mask):
        pooled = self.emb(ids).mean(1)
        if not self.training:  # an op the compiler lacks, in evaluation only
            pooled = torch.cummax(pooled, dim=1).values
        return self.head(pooled)


def bag(vocab_size, num_labels):
    return Bag(vocab_size, num_labels)
"""


def test_a_task_evaluated_eagerly_is_compiled_here(
    tmp_path: Path, task: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "eager_eval.py").write_text(_EAGER_EVAL)
    assert FinetuneConfig().compile_in == "child"  # the default route, which falls back
    options = {**task, "model": "eager_eval:bag", "epochs": 1}
    with caplog.at_level(logging.WARNING, logger="pockengine.finetune"):
        run = pe.finetune(**options, out=str(tmp_path / "run"))
    assert "does not compile and runs on the model: compiling here" in caplog.text
    assert run.finished and len(run.history) == 1  # validated eagerly, on the model
    assert not list((tmp_path / "run").glob(".compiled-*"))


def test_refill_keeps_what_the_step_lacks_and_checks_shapes(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    arrays: dict[str, Any] = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.ones(4, np.int64),
    }
    with src.open("wb") as f:
        write_safetensors_to(f, arrays, {"format": "pt"})
    new = np.full((2, 3), 7.0, np.float64)  # cast to the file's float32
    refill(src, dst, {"a": new}.get)
    back = load_file(str(dst))
    np.testing.assert_array_equal(back["a"], new.astype(np.float32))
    np.testing.assert_array_equal(back["b"], arrays["b"])
    assert dst.stat().st_size == src.stat().st_size
    with pytest.raises(pe.FinetuneError, match=r"a is \[3, 2\], the model's \[2, 3\]"):
        refill(src, dst, {"a": np.zeros((3, 2), np.float32)}.get)


def test_broadcast_data_travels_compact(tmp_path: Path) -> None:
    """A split's array broadcast along an axis (lite0-fashion's three identical channels,
    ``vision.preprocess``) is written once with its shape and read back as the same
    broadcast view, so the process that trains holds a third of the images."""
    import numpy as np
    from torch import nn

    from pockengine.finetune.compiling import compiled_task
    from pockengine.safetensors_io import LazyTensors
    from pockengine.tasks import vision
    from pockengine.tasks.recipes import Task

    images = np.random.default_rng(0).integers(0, 256, (10, 28, 28), np.uint8)
    x, y = vision.preprocess(images, 16), np.arange(10) % 3
    assert x.shape == (10, 3, 16, 16) and x.strides[1] == 0
    task = Task("t", nn.Linear(2, 2), None, (x, y), (x[:4], y[:4]), ("a", "b", "c"))  # type: ignore[arg-type]
    compiled_task.save_task(tmp_path, task)
    stored = LazyTensors(tmp_path / compiled_task.TASK_DATA)
    assert stored["train.0"].shape == (10, 1, 16, 16)
    loaded, _ = compiled_task._load_task(tmp_path)
    for got, want in zip((*loaded.train, *loaded.val), (*task.train, *task.val), strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape and got.strides[1:2] == want.strides[1:2]
    assert loaded.train[1].strides == (8,) and loaded.test == ()


def test_damaged_task_is_a_clear_error(tmp_path: Path) -> None:
    """A task file whose stored shape does not fit its array, or that misses an array or
    its description, is a ``FinetuneError`` naming the file and the entry, not a numpy or
    KeyError traceback from deep inside the load."""
    import json

    import numpy as np
    from torch import nn

    from pockengine.finetune.compiling import compiled_task
    from pockengine.safetensors_io import write_safetensors_to
    from pockengine.tasks import vision
    from pockengine.tasks.recipes import Task

    images = np.random.default_rng(0).integers(0, 256, (6, 28, 28), np.uint8)
    x, y = vision.preprocess(images, 8), np.arange(6) % 2
    task = Task("t", nn.Linear(2, 2), None, (x, y), (x[:2], y[:2]), ("a", "b"))  # type: ignore[arg-type]
    compiled_task.save_task(tmp_path, task)
    data = tmp_path / compiled_task.TASK_DATA
    arrays = dict(compiled_task.read_tensors(data))
    arrays["train.0.shape"] = np.asarray([6, 3, 9, 9], np.int64)
    with data.open("wb") as f:
        write_safetensors_to(f, arrays)
    with pytest.raises(pe.FinetuneError, match=r"train\.0\.shape = \[6, 3, 9, 9\] does not fit"):
        compiled_task._load_task(tmp_path)
    del arrays["train.0.shape"], arrays["train.0"]
    with data.open("wb") as f:
        write_safetensors_to(f, arrays)
    with pytest.raises(pe.FinetuneError, match=r"has no array 'train\.0'"):
        compiled_task._load_task(tmp_path)
    compiled_task.save_task(tmp_path, task)
    info = json.loads((tmp_path / compiled_task.TASK_JSON).read_text())
    del info["labels"]
    (tmp_path / compiled_task.TASK_JSON).write_text(json.dumps(info))
    with pytest.raises(pe.FinetuneError, match=r"damaged or incomplete \(KeyError"):
        compiled_task._load_task(tmp_path)
