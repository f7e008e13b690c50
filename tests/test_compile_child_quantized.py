"""The compile child with quantized frozen weights (``compile_child.compile_into``).

- a run whose frozen embedding is stored int8 trains and writes ``RUN/model`` through the
  child exactly as in-process, though the child's skeleton holds zeros for that weight
  (``write_skeleton(zeroed=...)``) and its model never holds the float copy after compiling;
- ``refill`` refuses to keep a zeroed tensor the step gave no value for;
- ``safetensors_io.write_rows`` writes a broadcast stand-in in blocks, the same bytes as a
  C-ordered copy.
"""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import pockengine as pe
from pockengine import safetensors_io
from pockengine.finetune.compiling.model_skeleton import SKELETON, refill
from pockengine.safetensors_io import write_rows, write_safetensors_to
from tests.test_compile_child import _same_checkpoint, _same_model
from tests.test_finetune_resume import write_task


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    scheme = tmp_path / "head.json"
    scheme.write_text(json.dumps({"scheme": "select", "train": ["head.*"]}))
    options = write_task(tmp_path, rows=48, module="int8_bag")
    return {**options, "epochs": 1, "scheme": str(scheme), "frozen_dtype": "int8"}


@pytest.mark.slow  # two fine-tuning runs (tests/test_compile_child.py: the default one)
def test_an_int8_run_compiled_in_a_child_writes_the_same_model(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pockengine.finetune.compiling import model_skeleton

    skeletons: list[dict[str, Any]] = []
    real = model_skeleton.write_from_skeleton

    def spy(out: Path, skeleton: Path, *args: Any) -> Path:
        skeletons.append(json.loads((skeleton / SKELETON).read_text()))
        zeros = load_file(str(skeleton / "model.safetensors"))["emb.weight"]
        assert not zeros.any()  # the child never wrote the embedding's float values
        return real(out, skeleton, *args)

    trainer = importlib.import_module(
        "pockengine.finetune.running.trainer"
    )  # (pe.finetune: a function)
    monkeypatch.setattr(trainer, "write_from_skeleton", spy)
    here = pe.finetune(**task, out=str(tmp_path / "here"), compile_in="process")
    child = pe.finetune(**task, out=str(tmp_path / "child"), compile_in="child")
    assert [s["zeroed"] for s in skeletons] == [["emb.weight"]]
    assert child.steps == here.steps and child.history == here.history
    _same_checkpoint(here.checkpoint, child.checkpoint)
    _same_model(tmp_path / "here" / "model", tmp_path / "child" / "model")
    weights = load_file(str(tmp_path / "child" / "model" / "model.safetensors"))
    assert weights["emb.weight"].any()  # the step's dequantized values


def test_refill_refuses_a_zeroed_tensor_the_step_does_not_give(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    with src.open("wb") as f:
        write_safetensors_to(f, {"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(pe.FinetuneError, match="w holds zeros in place of a weight"):
        refill(src, dst, {}.get, {"w"})
    refill(src, dst, {"w": np.ones((2, 3), np.float32)}.get, {"w"})
    np.testing.assert_array_equal(load_file(str(dst))["w"], np.ones((2, 3), np.float32))


@pytest.mark.parametrize("shape", [(5, 3), (7,), (0, 4), ()])
def test_write_rows_writes_stand_ins_in_c_order(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safetensors_io, "_BLOCK", 8)  # two float32s a block: several blocks
    values = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    for array in (values, np.broadcast_to(np.float32(3), shape), values.T):
        out = io.BytesIO()
        write_rows(out, array)
        assert out.getvalue() == np.ascontiguousarray(array).tobytes()


def test_only_the_given_weights_the_scheme_freezes_get_stand_ins() -> None:
    """A GGUF-given weight the scheme trains starts from the model's float values: the
    child keeps them (``frozen_given``); tied names count as one weight."""
    from pockengine import zoo
    from pockengine.finetune.compiling.compile_child import frozen_given

    model = zoo.llama_lm(layers=1, tied=True).model
    q, k = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qk")
    given = ["model.embed_tokens.weight", q, k]
    assert frozen_given(model, given, pe.schemes.select([q])) == ["model.embed_tokens.weight", k]
    assert frozen_given(model, ["lm_head.weight", k], pe.schemes.select(["*embed_tokens*"])) == [k]
