"""The step artifact (``pockengine.step.artifact``): save -> load_step -> train.

- a loaded step trains bit-identically to the step it was saved from (losses, params,
  buffers, optimizer state) on the NumPy and torch backends, with int8 frozen weights,
  GGUF blocks (Q4_0, Q8_0) used as given and a partial-channel scheme; its report, names
  and ``load_state`` are the original's;
- a process that loads and runs it imports no frontend, no torch.export, no transformers
  (and, for a NumPy step, no torch at all), and its saved evaluator gives the original's
  results;
- a missing, damaged or mismatched file is one ``StepFileError`` naming the file;
- ``pockengine export --target step`` writes it; non-finite float attrs survive the IR text.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.cli import main
from pockengine.ir import ParseError, print_graph
from pockengine.ir.parser import parse_graph
from pockengine.safetensors_io import write_safetensors_to
from pockengine.sparse import schemes
from pockengine.step.artifact import StepFileError, load_step, read_tensors
from pockengine.tasks.gguf import decode_blocks

Array = np.ndarray[Any, Any]
_LAYER = "encoder.encoder.layer.0"
_SCHEME = schemes.select(
    ["*LayerNorm*", "*intermediate*", "head.*"], channels={"*intermediate*": 0.5}
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gguf(w: zoo.Workload) -> dict[str, Any]:
    """Two frozen weights as GGUF blocks (Q4_0, Q8_0), used as given."""
    state = w.model.state_dict()
    out = {}
    for name, kind in ((f"{_LAYER}.output.dense.weight", "Q4_0"),
                       (f"{_LAYER}.attention.self.value.weight", "Q8_0")):  # fmt: skip
        weight = state[name].numpy()
        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
        out[name] = decode_blocks(blocks, kind, weight.shape)
    return out


def _compile(backend: str) -> tuple[zoo.Workload, pe.TrainStep]:
    w = zoo.bert_classifier(layers=1, vocab=96)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.AdamW(lr=1e-3),
                      scheme=_SCHEME, backend=backend, frozen_dtype="int8",
                      quantized=_gguf(w))  # fmt: skip
    return w, step


@pytest.fixture(scope="module")
def numpy_step() -> tuple[zoo.Workload, pe.TrainStep]:
    return _compile("numpy")


def _equal_state(a: Any, b: Any) -> None:
    for get in ("flat_state_dict", "optimizer_state"):
        want, got = getattr(a, get)(), getattr(b, get)()
        assert want.keys() == got.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
            assert got[name].dtype == value.dtype


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_loaded_step_trains_bit_identically(backend: str, tmp_path: Path) -> None:
    w, step = _compile(backend)
    assert {f"{_LAYER}.output.dense.weight", "head.weight"} & set(step._quantized) == {
        f"{_LAYER}.output.dense.weight"
    }  # given blocks stay codes, the trained head stays float
    assert step.resolution.rows[f"{_LAYER}.intermediate.dense.weight"] == 64  # partial
    step(*w.make_batch(1))  # saved mid-run: optimizer state and step count are not initial
    loaded = load_step(step.save(tmp_path / "step"))
    assert loaded.backend.name == backend
    for attr in ("trained", "written", "state_names", "lr"):
        assert getattr(loaded, attr) == getattr(step, attr), attr
    assert str(loaded.report(depth=2)) == str(step.report(depth=2))
    assert loaded.report().to_dict() == step.report().to_dict()
    for k in range(3):
        batch = w.make_batch(2 + k)
        assert loaded(*batch) == step(*batch)
    _equal_state(step, loaded)


def test_load_state_and_lr_work_on_a_loaded_step(
    numpy_step: tuple[zoo.Workload, pe.TrainStep], tmp_path: Path
) -> None:
    w, step = numpy_step
    loaded = load_step(step.save(tmp_path / "step"))
    loaded.lr = 0.5
    loaded(*w.make_batch(7))
    assert loaded.lr == 0.5
    loaded.load_state(step.state_dict(), step.optimizer_state())  # back to the original
    loaded.lr = step.lr
    _equal_state(step, loaded)
    with pytest.raises(pe.StateError, match="missing"):
        loaded.load_state({"head.bias": np.zeros(3, np.float32)})
    with pytest.raises(pe.BatchError, match="batch entry 0"):
        loaded(*(b[:1] for b in w.make_batch(0)))


_CHILD = """
import json, sys
import numpy as np
import pockengine as pe
folder = sys.argv[1]
step = pe.load_step(folder)
with np.load(folder + "/batches.npz") as data:
    batches = [tuple(data[n][k] for n in data.files) for k in range(3)]
losses = [step(*b) for b in batches]
evaluated = step.evaluator()(*batches[0]).tolist()
heavy = ("torch", "torch.export", "torch._dynamo", "transformers", "sympy", "onnx", "jax")
loaded = [m for m in sys.modules if m in heavy or m.startswith("pockengine.frontend.")]
print(json.dumps({"losses": losses, "evaluated": evaluated, "modules": loaded}))
"""


def test_a_process_that_loads_the_step_runs_no_compiler(
    numpy_step: tuple[zoo.Workload, pe.TrainStep], tmp_path: Path
) -> None:
    w, step = numpy_step
    evaluator = step.evaluator(w.model, w.loss_fn, w.make_batch(0))
    folder = step.save(tmp_path / "step", evaluator)
    batches = [w.make_batch(10 + k) for k in range(3)]
    stacked = {f"b{i}": np.stack([b[i].numpy() for b in batches]) for i in range(3)}
    np.savez(folder / "batches.npz", **stacked)  # type: ignore[arg-type]
    run = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], capture_output=True,
                         text=True, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    # only pockengine.frontend.imported (dataclasses) of the frontend package, no torch
    assert set(got["modules"]) <= {"pockengine.frontend.imported"}, got["modules"]
    want = [step(*b) for b in batches]
    assert got["losses"] == want
    assert got["evaluated"] == evaluator(*batches[0]).tolist()


def _saved(step: pe.TrainStep, tmp_path: Path) -> Path:
    return step.save(tmp_path / "step")


def test_damaged_missing_or_mismatched_files_name_the_file(
    numpy_step: tuple[zoo.Workload, pe.TrainStep], tmp_path: Path
) -> None:
    step = numpy_step[1]
    folder = _saved(step, tmp_path)
    with pytest.raises(StepFileError, match="no evaluator"):
        load_step(folder).evaluator()
    with pytest.raises(StepFileError, match=r"nowhere[/\\]step.json: missing"):
        load_step(tmp_path / "nowhere")
    state = folder / "state.safetensors"
    data = state.read_bytes()
    state.write_bytes(data[:-10])
    with pytest.raises(StepFileError, match=re.escape("state.safetensors: truncated")):
        load_step(folder)
    arrays = {k: step.backend.to_numpy(v) for k, v in step._store.items()}
    arrays["head.bias"] = np.zeros(5, np.float32)  # another shape than the graph's
    with state.open("wb") as f:
        write_safetensors_to(f, arrays)
    with pytest.raises(StepFileError, match=r"state.safetensors: head.bias is float32\[5\]"):
        load_step(folder)
    other = zoo.mlp()
    pe.compile(other.model, other.loss_fn, other.make_batch(0)).save(tmp_path / "mlp")
    (folder / "step.ir").write_bytes((tmp_path / "mlp" / "step.ir").read_bytes())
    with pytest.raises(StepFileError, match=re.escape("step.ir: not the graph step.json")):
        load_step(folder)
    meta = folder / "step.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 99}))
    with pytest.raises(StepFileError, match=re.escape("step.json: step artifact format 99")):
        load_step(folder)
    meta.write_text("{")
    with pytest.raises(StepFileError, match=re.escape("step.json: not readable JSON")):
        load_step(folder)


def test_a_damaged_meta_file_is_named(
    numpy_step: tuple[zoo.Workload, pe.TrainStep], tmp_path: Path
) -> None:
    folder = _saved(numpy_step[1], tmp_path)
    meta = json.loads((folder / "step.json").read_text())
    del meta["optimizer"]
    (folder / "step.json").write_text(json.dumps(meta))
    with pytest.raises(StepFileError, match=re.escape("step.json: damaged (KeyError: 'optimizer'")):
        load_step(folder)


def test_read_tensors_gives_back_what_was_written(tmp_path: Path) -> None:
    arrays: dict[str, Array] = {
        "a": np.arange(6, dtype=np.int8).reshape(2, 3),
        "s": np.asarray(2.5, np.float32),
        "b": np.linspace(0, 1, 5, dtype=np.float64),
        "e": np.zeros((0, 4), np.int64),
    }
    with (tmp_path / "t.safetensors").open("wb") as f:
        write_safetensors_to(f, arrays)
    back = read_tensors(tmp_path / "t.safetensors")
    for name, value in arrays.items():
        np.testing.assert_array_equal(back[name], value)
        assert back[name].dtype == value.dtype and back[name].flags.aligned


def test_non_finite_attrs_survive_the_text_and_bad_literals_are_parse_errors() -> None:
    text = """graph g(x: f32[2] input) {
  %a: f32[2] = full(shape=(2,), value=-inf, dtype='f32')
  %b: f32[2] = full(shape=(2,), value=nan, dtype='f32')
  return %a, %b
}"""
    graph = parse_graph(text)
    values = [n.attrs["value"] for n in graph.nodes]
    assert values[0] == float("-inf") and values[1] != values[1]  # nan
    assert parse_graph(print_graph(graph)).nodes[0] == graph.nodes[0]
    with pytest.raises(ParseError, match=re.escape("line 2: attribute value 'np.float32")):
        parse_graph(text.replace("-inf", "np.float32(1)"))


def test_export_target_step_writes_an_artifact(tmp_path: Path) -> None:
    folder = tmp_path / "mlp_step"
    assert main(["export", "mlp", "--target", "step", "-o", str(folder)]) == 0
    loaded = load_step(folder)
    work, optimizer = zoo.benchmark("mlp")
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), optimizer=optimizer)
    batch = work.make_batch(3)
    assert loaded(*batch) == step(*batch)
