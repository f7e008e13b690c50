"""The exported training step: ``TrainStep.export`` and ``pockengine export`` write an ONNX
model plus its state, and ``pockengine/ort_runner.py``, copied beside them and run in a
process where torch and pockengine cannot be imported, trains on exactly the NumPy
backend's trajectory (losses, weights, BatchNorm statistics, dropout masks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import pockengine as pe
from pockengine import zoo
from pockengine.backends.onnx.export import state_path

RUNNER = Path(pe.__file__).parent / "ort_runner.py"
_BLOCKED = "raise ImportError('{name} is blocked in this test')\n"


def _deploy(tmp_path: Path, block: tuple[str, ...] = ("torch", "pockengine")) -> dict[str, str]:
    """The runner copied beside the artifact, and an environment in which importing the
    blocked packages fails (stub modules first on the path shadow the installed ones)."""
    shutil.copy(RUNNER, tmp_path / "ort_runner.py")
    stubs = tmp_path / "blocked"
    stubs.mkdir(exist_ok=True)
    for name in block:
        (stubs / f"{name}.py").write_text(_BLOCKED.format(name=name))
    return {**os.environ, "PYTHONPATH": str(stubs), "OMP_NUM_THREADS": "1"}


def _run_runner(tmp_path: Path, env: dict[str, str], *args: str) -> list[float]:
    code = (
        "import runpy, sys\n"
        "for name in ('torch', 'pockengine'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(name + ' is importable')\n"
        f"runner = runpy.run_path({str(tmp_path / 'ort_runner.py')!r})\n"
        f"code = runner['main']({list(args)!r})\n"
        "assert not any(m.split('.')[0] in ('torch', 'pockengine') for m in sys.modules)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [float(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


def _stack(batches: list[tuple[Any, ...]], path: Path) -> None:
    arrays = {str(i): np.stack([np.asarray(b[i]) for b in batches]) for i in range(len(batches[0]))}
    np.savez(path, **arrays)


def _load_weights(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return dict(load_file(str(path)))
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_exported_step_trains_without_torch(tmp_path: Path, backend: str) -> None:
    """A CNN with train-mode BatchNorm and dropout, SGD with momentum: five steps in the
    torch-free runner against five steps of the NumPy backend."""
    work = zoo.small_cnn(dropout=0.5)
    batches = [tuple(t.numpy() for t in work.make_batch(i)) for i in range(5)]

    def opt() -> pe.optim.Optimizer:
        return pe.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)

    example = work.make_batch(0)
    exported = pe.compile(work.model, work.loss_fn, example, optimizer=opt(), backend=backend)
    side = exported.export(tmp_path / "train_step.onnx")
    assert side == state_path(tmp_path / "train_step.onnx") == tmp_path / "train_step.state.npz"
    reference = pe.compile(work.model, work.loss_fn, example, optimizer=opt())
    want = [reference(*b) for b in batches]
    _stack(batches, tmp_path / "batches.npz")
    env = _deploy(tmp_path)
    got = _run_runner(
        tmp_path,
        env,
        "train_step.onnx",
        "--batches",
        "batches.npz",
        "--json",
        "--save",
        "weights.safetensors",
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    weights = _load_weights(tmp_path / "weights.safetensors")
    state = reference.state_dict()
    assert set(weights) == set(state)
    for name, value in state.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_runner_saves_npz_without_safetensors_and_resumes(tmp_path: Path) -> None:
    """AdamW (moments, step count, learning rate): 3 steps, save the state, resume for 2 more
    in a fresh session: the same as 5 steps of the NumPy backend."""
    work = zoo.mlp()
    batches = [tuple(t.numpy() for t in work.make_batch(i)) for i in range(5)]
    step = pe.compile(
        work.model, work.loss_fn, work.make_batch(0), optimizer=pe.optim.AdamW(lr=1e-2)
    )
    step.export(tmp_path / "mlp.onnx")
    want = [step(*b) for b in batches]
    _stack(batches[:3], tmp_path / "first.npz")
    _stack(batches[3:], tmp_path / "last.npz")
    env = _deploy(tmp_path, block=("torch", "pockengine", "safetensors"))
    got = _run_runner(
        tmp_path,
        env,
        "mlp.onnx",
        "--batches",
        "first.npz",
        "--json",
        "--save-state",
        "resume.npz",
        "--save",
        "w.safetensors",
    )
    assert not (tmp_path / "w.safetensors").exists() and (tmp_path / "w.npz").exists()
    got += _run_runner(
        tmp_path,
        env,
        "mlp.onnx",
        "--state",
        "resume.npz",
        "--batches",
        "last.npz",
        "--json",
        "--save",
        "w.npz",
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    weights = _load_weights(tmp_path / "w.npz")
    for name, value in step.state_dict().items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_runner_as_a_module_sets_the_learning_rate(tmp_path: Path) -> None:
    work = zoo.mlp()
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), optimizer=pe.optim.SGD(lr=0.1))
    batch = tuple(t.numpy() for t in work.make_batch(0))
    step.export(tmp_path / "s.onnx")
    spec = importlib.util.spec_from_file_location("ort_runner", RUNNER)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    session = runner.TrainingSession(str(tmp_path / "s.onnx"))
    assert session.lr == pytest.approx(0.1)
    session.lr = step.lr = 0.5
    for _ in range(3):
        assert session.step(*batch) == pytest.approx(step(*batch), rel=1e-5)
    assert session.steps == 3
    with pytest.raises(ValueError, match="expected 2 batch arrays"):
        session.step(batch[0])
    # Saving goes through a temporary name renamed into place and never follows a link.
    outside = tmp_path / "outside.npz"
    outside.write_bytes(b"user data")
    (tmp_path / "linked.npz").symlink_to(outside)
    with pytest.raises(SystemExit, match="symbolic link"):
        session.save(str(tmp_path / "linked.npz"))
    with pytest.raises(SystemExit, match="symbolic link"):
        session.save_state(str(tmp_path / "linked.npz"))
    assert outside.read_bytes() == b"user data"
    (tmp_path / "w.npz").write_bytes(b"old")
    assert session.save(str(tmp_path / "w.npz")) == str(tmp_path / "w.npz")
    weights = _load_weights(tmp_path / "w.npz")
    for name, value in step.state_dict().items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_cli_export(tmp_path: Path) -> None:
    from pockengine.cli import main

    out = tmp_path / "cli.onnx"
    assert main(["export", "mlp", "-o", str(out), "--scheme", "bias"]) == 0
    assert out.exists() and state_path(out).exists()
    work = zoo.mlp()
    _stack([tuple(t.numpy() for t in work.make_batch(i)) for i in range(2)], tmp_path / "b.npz")
    losses = _run_runner(
        tmp_path, _deploy(tmp_path), "cli.onnx", "--batches", "b.npz", "--steps", "3", "--json"
    )
    assert len(losses) == 3 and losses[2] < losses[0]
