"""Hostile and broken inputs (issue 20): each ends in the engine's own error, runs nothing
from a model folder, and leaves every file and model as it was.

Sections: model folders (nothing executes), non-finite steps (no update), class targets,
strict loading, the command line (a table of broken options and files), one run per
folder, and Hypothesis fuzzing of scheme files, data files and checkpoint bytes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pockengine as pe
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from pockengine.finetune.running.run_lock import LOCK
from pockengine.ir import GRAD_PREFIX, PockEngineError, SchemeError
from pockengine.sparse import schemes
from pockengine.step.compiler import BatchError, NonFiniteError, StateError
from pockengine.tasks import data as ds
from pockengine.tasks import models
from pockengine.tasks.config import FinetuneError
from tests.test_finetune_resume import write_task

BACKENDS = ("numpy", "torch", "onnxruntime")


# -- helpers ---------------------------------------------------------------------------


def tiny_bert(folder: Path, tokenizer: bool = True) -> Path:
    """A one-block BERT folder (random weights, safetensors) with a word-piece vocabulary."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=32)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    if tokenizer:
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "the"]
        (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def cli_fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in-process: a non-zero exit, one ``error:`` line, no traceback."""
    code = main(args)
    err = capsys.readouterr().err
    assert code != 0, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    return err[err.index("error:") :]


def state_of(step: Any) -> dict[str, np.ndarray]:
    return {**step.flat_state_dict(), **step.optimizer_state()}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_task(tmp_path, rows=64, module="tiny_bag_hostile")


def cli_args(task: dict[str, Any], **changes: Any) -> list[str]:
    args = ["finetune"]
    for key, value in {**task, **changes}.items():
        if value is not None:
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


# -- model folders: nothing in them executes -------------------------------------------

EVIL_CODE = "open({marker!r}, 'w').write('ran')\nfrom transformers import BertModel as Evil\n"


def evil_folder(tmp_path: Path, config_file: str = "config.json") -> tuple[Path, Path]:
    folder, marker = tiny_bert(tmp_path / "evil"), tmp_path / "PWNED"
    path = folder / config_file
    content = json.loads(path.read_text()) if path.exists() else {}
    content["auto_map"] = {"AutoModel": "evil.Evil", "AutoTokenizer": ["evil.Evil", None]}
    path.write_text(json.dumps(content))
    (folder / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    return folder, marker


@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_folder_asking_for_its_own_code_is_refused(
    tmp_path: Path,
    task: dict[str, Any],
    config_file: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder, marker = evil_folder(tmp_path, config_file)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\ny\n"))  # a "yes" must not matter
    before = snapshot(tmp_path)
    err = cli_fails([*cli_args(task, model=folder), "--out", str(tmp_path / "out")], capsys)
    assert "needs its own Python code" in err and "never runs code" in err
    assert not marker.exists() and snapshot(tmp_path) == before
    with pytest.raises(FinetuneError, match="needs its own Python code"):
        models.load_hf_encoder(str(folder)) if config_file == "config.json" else \
            models.load_hf_tokenizer(str(folder))  # fmt: skip
    assert not marker.exists()


def test_yes_on_a_pipe_runs_nothing(tmp_path: Path, task: dict[str, Any]) -> None:
    """As a user would run it: a subprocess with "y" on standard input."""
    folder, marker = evil_folder(tmp_path)
    args = [sys.executable, "-m", "pockengine", *cli_args(task, model=folder)]
    done = subprocess.run([*args, "--out", str(tmp_path / "out")], input="y\n" * 5,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs its own Python code" in done.stderr and "[y/N]" not in done.stdout
    assert not marker.exists()


def test_pickle_only_folder_names_the_conversion(tmp_path: Path) -> None:
    folder = tiny_bert(tmp_path / "pickled")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded: unpickling can run code")
    with pytest.raises(FinetuneError, match="pickled weights only") as info:
        models.load_hf_encoder(str(folder))
    assert "save_pretrained" in str(info.value) and str(folder) in str(info.value)


def test_truncated_weights_name_the_file(tmp_path: Path) -> None:
    folder = tiny_bert(tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FinetuneError, match=r"model\.safetensors is truncated or corrupt"):
        models.load_hf_encoder(str(folder))


def test_folder_without_tokenizer_needs_one(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    bare, words = tiny_bert(tmp_path / "bare", tokenizer=False), tiny_bert(tmp_path / "tok")
    out = tmp_path / "out"
    err = cli_fails([*cli_args(task, model=bare, seq_len=8), "--out", str(out)], capsys)
    assert "has no tokenizer files" in err and "--tokenizer" in err
    # with --tokenizer, the one-block model trains under the default scheme (auto)
    args = cli_args(task, model=bare, tokenizer=words, seq_len=8, epochs=1)
    assert main([*args, "--out", str(out), "--max-steps", "2"]) == 0
    assert checkpoint.load(out / checkpoint.CHECKPOINT).counters["step"] == 2


# -- non-finite steps apply no update --------------------------------------------------


def small_model() -> tuple[torch.nn.Module, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))  # fmt: skip

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x), y)

    return model, loss_fn, (torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))


OPTIMIZERS = {
    "sgd": lambda: pe.optim.SGD(lr=0.1, weight_decay=0.01),
    "momentum": lambda: pe.optim.SGD(lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: pe.optim.AdamW(lr=0.01),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_nonfinite_step_changes_nothing(backend: str, optimizer: str) -> None:
    model, loss_fn, (x, y) = small_model()
    step = pe.compile(model, loss_fn, (x, y), optimizer=OPTIMIZERS[optimizer](), backend=backend)
    step(x, y)
    before = state_of(step)
    for poison in (float("nan"), float("inf")):
        bad = x.clone()
        bad[2, 1] = poison
        with pytest.raises(NonFiniteError, match=r"step \d: the loss is (nan|inf)"):
            step(bad, y)
        assert_same(state_of(step), before)  # params, BN statistics, moments, step count
    step.on_nonfinite = "skip"
    assert not np.isfinite(step(bad, y)) and step.skipped_steps == 3
    assert_same(state_of(step), before)
    assert np.isfinite(step(x, y)) and step.calls == 5
    with pytest.raises(ValueError, match="on_nonfinite"):
        step.on_nonfinite = "ignore"


def test_exported_step_skips_nonfinite_batches_in_ort_runner(tmp_path: Path) -> None:
    """The gate is in the exported ONNX graph: ort_runner writes nothing back either."""
    import importlib.util

    model, loss_fn, (x, y) = small_model()
    step = pe.compile(model, loss_fn, (x, y), optimizer=pe.optim.AdamW(lr=0.01))
    step.export(tmp_path / "s.onnx")
    spec = importlib.util.spec_from_file_location("ort_runner", Path(pe.__file__).parent /
                                                  "ort_runner.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    session = runner.TrainingSession(str(tmp_path / "s.onnx"))
    session.step(x.numpy(), y.numpy())
    before = session.state_dict()
    bad = x.numpy().copy()
    bad[0, 0] = np.nan
    assert np.isnan(session.step(bad, y.numpy())) and session.skipped_steps == 1
    assert_same(session.state_dict(), before)
    with pytest.raises(ValueError, match="finite number > 0"):
        session.lr = float("inf")


def test_gate_is_computed_before_updates_move_into_the_backward() -> None:
    """One scalar test right after the loss; reorder_updates still interleaves updates
    with the backward (the last layer's update runs before the first layer's gradient)."""
    model, loss_fn, batch = small_model()
    graph = pe.compile(model, loss_fn, batch).graph
    ops = [n.op for n in graph.nodes]
    assert ops.count("nonfinite") == 1
    gate = ops.index("nonfinite")
    updates = [i for i, n in enumerate(graph.nodes) if n.op.endswith("update")]
    assert all(graph.nodes[i].inputs[-1].name == graph.nodes[gate].outputs[0].name
               for i in updates)  # fmt: skip
    backward = [i for i, n in enumerate(graph.nodes) if n.source.startswith(GRAD_PREFIX)]
    assert gate < min(updates) < max(backward)


# -- class targets ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ([0, 1, -1, 0, 1, 2], "class target -1 at position 2 is outside [0, 3)"),
        ([0, 1, 2, 3, 1, 2], "class target 3 at position 3 is outside [0, 3)"),
        ([0, 1, 2, 0, 1, 99], "class target 99 at position 5"),
    ],
)
def test_class_targets_out_of_range(backend: str, labels: list[int], message: str) -> None:
    model, loss_fn, (x, y) = small_model()
    step = pe.compile(model, loss_fn, (x, y), backend=backend)
    before = state_of(step)
    with pytest.raises(BatchError, match="batch entry 1: ") as info:
        step(x, torch.tensor(labels))
    assert message in str(info.value)
    assert_same(state_of(step), before)


def test_ignore_index_still_works() -> None:
    model, loss_fn, (x, y) = small_model()
    y = torch.tensor([0, -100, 2, 0, -100, 2])
    with torch.no_grad():
        want = float(loss_fn(model, x, y))
    step = pe.compile(model, loss_fn, (x, y), backend="torch")
    assert step(x, y) == pytest.approx(want, rel=1e-5)


def test_token_ids_out_of_range() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(),
                                torch.nn.Linear(8, 3))  # fmt: skip
    ids, y = torch.ones(6, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    step = pe.compile(model, lambda m, i, t: torch.nn.functional.cross_entropy(m(i), t), (ids, y))
    with pytest.raises(BatchError, match=r"token id 10 at position \(4, 1\) is outside \[0, 10\)"):
        step(ids.index_put((torch.tensor(4), torch.tensor(1)), torch.tensor(10)), y)


# -- the API: a table of hostile calls -------------------------------------------------


def _compile_with(**changes: Any) -> Any:
    model, loss_fn, batch = small_model()
    args = {"model": model, "loss_fn": loss_fn, "example_batch": batch, **changes}
    return pe.compile(**args)


def _call_with(*batch: Any) -> Any:
    model, loss_fn, example = small_model()
    return pe.compile(model, loss_fn, example)(*batch)


API_CASES = [
    (lambda: _compile_with(loss_fn=lambda m, x, y: (m(x).sum(), 1)), pe.CompileError,
     "loss_fn must return one scalar tensor, got 2 outputs"),
    (lambda: _compile_with(loss_fn=lambda m, x, y: m(x).sum(0)), pe.CompileError,
     "must return a float scalar"),
    (lambda: pe.optim.SGD(lr=float("inf")), pe.CompileError, "lr=inf must be a finite number"),
    (lambda: pe.optim.AdamW(lr=float("nan")), pe.CompileError, "lr=nan must be a finite"),
    (lambda: pe.optim.SGD(lr=0.1, momentum=1.5), pe.CompileError, "momentum=1.5"),
    (lambda: _call_with(torch.randn(6, 4)), BatchError, "expected 2 batch tensors, got 1"),
    (lambda: _call_with(torch.randn(6, 4), torch.zeros(6)), BatchError, "batch entry 1"),
    (lambda: _call_with(torch.randn(5, 4), torch.zeros(5, dtype=torch.int64)), BatchError,
     "compiled for f32[6,4]"),
    (lambda: schemes.sparse(blocks=-1).resolve(_info()), SchemeError, "must be >= 0"),
    (lambda: schemes.from_dict({"scheme": "select", "train": [1]}), SchemeError,
     "holds 1, not a string"),
]  # fmt: skip


def _info() -> Any:
    from pockengine.frontend.torch import torch_model_info

    return torch_model_info(small_model()[0])


@pytest.mark.parametrize(("call", "error", "message"), API_CASES)
def test_hostile_api_calls(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)


def test_yaml_scheme_cannot_construct_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text(f'scheme: !!python/object/apply:os.system ["touch {tmp_path}/PWNED"]\n')
    with pytest.raises(SchemeError, match="does not parse") as info:
        schemes.load(path)
    assert "\n" not in str(info.value) and not (tmp_path / "PWNED").exists()


# -- strict loading --------------------------------------------------------------------


def test_load_state_is_strict_and_all_or_nothing() -> None:
    model, loss_fn, batch = small_model()
    step = pe.compile(model, loss_fn, batch, optimizer=pe.optim.AdamW())
    good = step.flat_state_dict()
    before = state_of(step)
    changed = {k: v + 1 if v.dtype.kind == "f" else v for k, v in good.items()}
    cases = [
        ({k: v for k, v in changed.items() if k != "3.weight"}, "1 missing (3.weight)"),
        ({**changed, "4.weight": good["3.weight"]}, "1 unexpected (4.weight)"),
        ({**changed, "3.weight": good["3.weight"].T}, "3.weight: shape [8, 3], expected [3, 8]"),
        ({**changed, "1.num_batches_tracked": np.float32(1.5)}, "dtype float32, expected int64"),
        ({**changed, "0.bias": "text"}, "0.bias: shape [], expected [8]"),
    ]
    for params, message in cases:
        with pytest.raises(StateError, match="nothing was loaded") as info:
            step.load_state(params)
        assert message in str(info.value)
        assert_same(state_of(step), before)
    with pytest.raises(StateError, match=r"1 unexpected \(optim\.nope\)"):
        step.load_state(optimizer={**step.optimizer_state(), "optim.nope": np.zeros(1)})
    partial = {k: v for k, v in changed.items() if k != "3.weight"}
    result = step.load_state(partial, strict=False)
    assert result.missing == ("3.weight",) and not result.unexpected
    np.testing.assert_array_equal(step.flat_state_dict()["3.bias"], changed["3.bias"])
    np.testing.assert_array_equal(step.flat_state_dict()["3.weight"], good["3.weight"])


def test_load_into_another_architecture_writes_nothing() -> None:
    model, loss_fn, batch = small_model()
    step = pe.compile(model, loss_fn, batch)
    step(*batch)
    torch.manual_seed(1)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3), torch.nn.Linear(3, 3))  # fmt: skip
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(StateError, match=r"2 missing \(4.weight, 4.bias\)"):
        step.load_into(wider)
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())
    result = step.load_into(wider, strict=False)
    assert result.missing == ("4.weight", "4.bias")
    assert torch.equal(wider[3].weight, torch.from_numpy(step.flat_state_dict()["3.weight"]))
    with pytest.raises(StateError, match=r"needs a torch\.nn\.Module"):
        step.load_into({"0.weight": 1})


@pytest.mark.parametrize("lr", [-1.0, 0.0, float("inf"), float("nan"), "fast", None])
def test_learning_rate_must_be_finite_and_positive(lr: Any) -> None:
    model, loss_fn, batch = small_model()
    step = pe.compile(model, loss_fn, batch, optimizer=pe.optim.SGD(lr=0.1))
    with pytest.raises(StateError, match=r"step\.lr must be"):
        step.lr = lr
    assert step.lr == pytest.approx(0.1)
    step.lr = 1e-3
    assert step.lr == pytest.approx(1e-3)


# -- the command line ------------------------------------------------------------------

SCHEME_FILES = [
    ({"scheme": "select", "trian": ["*"]}, "has no option 'trian'; did you mean 'train'?"),
    ({"scheme": "last_blocks", "k": "2"}, "option 'k' must be an integer, got '2'"),
    ({"scheme": "sparce"}, "unknown scheme 'sparce'; did you mean 'sparse'?"),
    ({"scheme": "full", "channels": {"*": "half"}}, "holds 'half', not a number"),
    ({"scheme": "sparse", "head": "yes"}, "option 'head' must be true/false"),
    ({"scheme": "last_blocks"}, "needs k"),
    ([1, 2], "must hold a mapping"),
]


@pytest.mark.parametrize(("content", "message"), SCHEME_FILES)
def test_scheme_files_checked_by_name_and_type(
    tmp_path: Path, task: dict[str, Any], content: Any, message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    path = tmp_path / "scheme.json"
    path.write_text(json.dumps(content))
    before = snapshot(tmp_path)
    err = cli_fails([*cli_args(task, scheme=path), "--out", str(tmp_path / "out")], capsys)
    assert message in err and "scheme.json" in err
    assert snapshot(tmp_path) == before


def _options(tmp_path: Path) -> list[tuple[dict[str, Any], str]]:
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "latin.csv").write_bytes(b"review,sentiment\ngood,pos\ncaf\xe9 bad,neg\n")
    return [
        ({"threads": -1}, "--threads: must be a whole number >= 1, got -1"),
        ({"lr": "inf"}, "--lr: must be a finite number, got inf"),
        ({"lr": "-1"}, "--lr: must be > 0"),
        ({"lr": "nan"}, "--lr: must be a finite number"),
        ({"batch_size": 0}, "--batch-size: must be a whole number >= 1"),
        ({"epochs": "two"}, "--epochs: 'two' is not a whole number"),
        ({"warmup": 1.5}, "--warmup: must be in [0, 1)"),
        ({"momentum": -0.5}, "--momentum: must be in [0, 1)"),
        ({"weight_decay": "inf"}, "--weight-decay: must be a finite number"),
        ({"encoding": "klingon"}, "unknown encoding 'klingon'"),
        ({"out": tmp_path / "a_file"}, "is a file, not a folder"),
        ({"data": tmp_path / "latin.csv"}, "latin.csv:3: not utf-8 text"),
        ({"scheme": "last:many"}, "last:K needs a whole number"),
        ({"model": "tiny_bag_hostile:missing"}, "has no callable 'missing'"),
        ({"tokenizer": tmp_path / "nowhere"}, "tokenizer folder"),
        ({"backend": "cuda-please"}, "backend must be one of numpy, torch"),
        ({"val_fraction": 0}, "val_fraction must be in (0, 1)"),
        ({"max_steps": 0}, "--max-steps: must be a whole number >= 1"),
    ]


def test_broken_options_fail_before_any_work(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    for changes, message in _options(tmp_path):
        changes = {"out": tmp_path / "out", **changes}
        before = snapshot(tmp_path)
        err = cli_fails(cli_args(task, **changes), capsys)
        assert message in err, (changes, err)
        assert snapshot(tmp_path) == before, changes
        assert not (tmp_path / "out").exists()


def test_encoding_option_reads_other_text(tmp_path: Path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes(b"text,label\ncaf\xe9,a\nthe,b\n")
    assert ds.load_dataset(path, encoding="latin-1").texts[0] == "café"
    folder = tmp_path / "docs"
    (folder / "x").mkdir(parents=True)
    (folder / "x" / "1.txt").write_bytes(b"ok \xff\xfe")
    assert ds.load_folder(folder, replace=True).replaced == 2


def test_resume_checks_the_checkpoint_covers_the_model(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The model gained a layer since the checkpoint: --resume refuses, naming it."""
    out = tmp_path / "out"
    assert main([*cli_args(task, max_steps=2), "--out", str(out)]) == 0
    saved = snapshot(out)
    source = tmp_path / "tiny_bag_hostile.py"
    grown = source.read_text().replace("self.head = ", "self.extra = nn.Linear(16, 16)\n"
                                       "        self.head = ")  # fmt: skip
    source.write_text(grown.replace("self.drop(pooled)", "self.drop(self.extra(pooled))"))
    monkeypatch.delitem(sys.modules, "tiny_bag_hostile", raising=False)
    capsys.readouterr()
    err = cli_fails([*cli_args(task), "--out", str(out), "--resume"], capsys)
    assert "does not fit" in err and "missing (extra.weight, extra.bias)" in err
    assert snapshot(out) == saved


def test_nonfinite_loss_in_a_run_keeps_the_checkpoint(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    out = tmp_path / "out"
    assert main([*cli_args(task, max_steps=2), "--out", str(out)]) == 0
    saved = (out / checkpoint.CHECKPOINT).read_bytes()
    source = tmp_path / "tiny_bag_hostile.py"
    source.write_text(source.read_text().replace("self.drop(pooled))", "self.drop(pooled * np))")
                      .replace("import torch\n", "import torch\nnp = float('nan')\n"))  # fmt: skip
    monkeypatch.delitem(sys.modules, "tiny_bag_hostile", raising=False)
    capsys.readouterr()
    err = cli_fails([*cli_args(task), "--out", str(out), "--resume"], capsys)
    assert "the loss is not finite at step 3" in err and "checkpoint is intact" in err
    assert (out / checkpoint.CHECKPOINT).read_bytes() == saved


def test_corrupt_checkpoint_on_resume(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([*cli_args(task, max_steps=2), "--out", str(out)]) == 0
    path = out / checkpoint.CHECKPOINT
    path.write_bytes(path.read_bytes()[:-7])
    saved = snapshot(out)
    err = cli_fails([*cli_args(task), "--out", str(out), "--resume"], capsys)
    assert "checkpoint.safetensors" in err and "truncated or corrupt" in err
    assert snapshot(out) == saved


# -- one folder, one run ---------------------------------------------------------------


def test_a_live_lock_refuses_and_a_stale_one_is_taken_over(
    tmp_path: Path, task: dict[str, Any], capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(f"{os.getppid()}\n")  # a process that is alive
    err = cli_fails([*cli_args(task, max_steps=2), "--out", str(out)], capsys)
    assert f"in use by another run (pid {os.getppid()}" in err
    assert [p.name for p in out.iterdir()] == [LOCK]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(f"{dead.pid}\n")
    assert main([*cli_args(task, max_steps=2, threads=1), "--out", str(out)]) == 0
    assert "taking over" in caplog.text and not (out / LOCK).exists()
    caplog.clear()
    assert main([*cli_args(task, threads=2), "--out", str(out), "--resume"]) == 0
    assert "results may differ" in caplog.text and "threads 1 -> 2" in caplog.text


# -- fuzzing: only PockEngine errors come out ------------------------------------------

_KEYS = ["scheme", "train", "trian", "freeze", "k", "blocks", "bias", "head", "container",
         "channels", "frozen_bn", "sparse"]  # fmt: skip
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=True)
    | st.sampled_from(["sparse", "full", "last_blocks", "select", "*", "0.*", "all", "eval"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)  # fmt: skip
_FUZZ = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


@_FUZZ
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=4))
def test_fuzz_scheme_dicts(content: dict[str, Any]) -> None:
    model, _, _ = small_model()
    from pockengine.frontend.torch import torch_model_info

    try:
        resolution = schemes.from_dict(content).resolve(torch_model_info(model))
    except SchemeError as exc:
        assert str(exc)  # a message, never an empty error
        return
    assert resolution.names <= {name for name, _ in model.named_parameters()}


@_FUZZ
@given(st.binary(max_size=200), st.sampled_from([".csv", ".tsv", ".jsonl"]))
def test_fuzz_data_files(tmp_path: Path, content: bytes, suffix: str) -> None:
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(b"text,label\n" + content if suffix == ".csv" else content)
    try:
        loaded = ds.load_dataset(path)
    except FinetuneError as exc:
        assert "fuzz" in str(exc)  # names the file
        return
    assert len(loaded.texts) == len(loaded.labels) > 0


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ckpt") / checkpoint.CHECKPOINT
    saved = checkpoint.Checkpoint(
        {"w": np.ones((3, 4), np.float32)}, {"optim.step": np.ones(())}, np.arange(4),
        {"step": 5}, {"lr": 0.1}, {"scheme": "full"},
    )  # fmt: skip
    checkpoint.save(path, saved)
    return path.read_bytes()


@_FUZZ
@given(st.data())
def test_fuzz_checkpoint_bytes(tmp_path: Path, checkpoint_bytes: bytes, data: Any) -> None:
    raw = bytearray(checkpoint_bytes)
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    path = tmp_path / checkpoint.CHECKPOINT
    path.write_bytes(bytes(raw))
    try:
        loaded = checkpoint.load(path)
    except PockEngineError as exc:
        assert checkpoint.CHECKPOINT in str(exc)  # names the file
        return
    assert isinstance(loaded.counters, dict) and loaded.order.ndim == 1  # flips in the data
