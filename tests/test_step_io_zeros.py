"""What saving a step costs: written one tensor at a time, all-zero state listed, not stored.

- a step saved before its first step (the compile child's case) writes no optimizer
  state: ``step.json`` lists the all-zero tensors, ``load_step`` allocates them, and the
  loaded step trains bit-identically to the original over 3 steps; an artifact of format
  1 (every tensor in the file, no list) still loads and trains the same;
- a tensor of -0.0 is not "zero" (its bytes are not): it is stored, sign included;
- a step bound inside ``copies_deferred`` shares the model's trained params until its
  first step (no second copy while it is only saved), never writes the model's memory,
  and trains as a step that copied them at once; outside it, only handed-over values
  (the optimizer's zeros) wait for the first step;
- ``read_tensors`` (one open file, ``LazyTensors``'s reader) names the damaged tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.optim import LR
from pockengine.safetensors_io import LazyTensors, header_bytes, write_safetensors_to
from pockengine.step.artifact import StepFileError, load_step, read_tensors
from pockengine.step.running import copies_deferred
from tests.test_step_io import _equal_state

Array = np.ndarray[Any, Any]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _compile(w: zoo.Workload, backend: str = "torch") -> pe.TrainStep:
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.AdamW(lr=1e-3),
                      backend=backend)  # fmt: skip


def _trains_alike(w: zoo.Workload, step: Any, loaded: Any) -> None:
    for k in range(3):
        batch = w.make_batch(1 + k)
        assert loaded(*batch) == step(*batch)
    _equal_state(step, loaded)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_step_saved_before_it_ran_stores_no_optimizer_zeros(backend: str, tmp_path: Path) -> None:
    w = zoo.mlp()
    step = _compile(w, backend)
    folder = step.save(tmp_path / "step")
    zeros = set(json.loads((folder / "step.json").read_text())["zeros"])
    moments = set(step.optimizer_state()) - {LR}
    assert moments and moments <= zeros  # AdamW's moments and its step count
    stored = set(LazyTensors(folder / "state.safetensors"))
    assert not stored & zeros
    assert LR in stored and LR not in zeros
    _trains_alike(w, step, load_step(folder))


def test_a_format_1_artifact_with_every_tensor_in_its_file_still_loads(tmp_path: Path) -> None:
    w = zoo.mlp()
    step = _compile(w)
    folder = step.save(tmp_path / "step")
    meta_path, state = folder / "step.json", folder / "state.safetensors"
    meta = json.loads(meta_path.read_text())
    arrays = dict(read_tensors(state))
    arrays.update(step.optimizer_state())  # the zeros written out, as format 1 did
    with state.open("wb") as f:
        write_safetensors_to(f, arrays)
    meta_path.write_text(json.dumps({**{k: v for k, v in meta.items() if k != "zeros"},
                                     "format": 1}))  # fmt: skip
    _trains_alike(w, step, load_step(folder))


@pytest.mark.parametrize("zeros", [5, "m", [3], ["no.such.value"]])
def test_a_damaged_zeros_list_is_a_step_file_error(zeros: Any, tmp_path: Path) -> None:
    folder = _compile(zoo.mlp()).save(tmp_path / "step")
    meta_path = folder / "step.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "zeros": zeros}))
    with pytest.raises(StepFileError, match=r"step\.json: .*zeros"):
        load_step(folder)


def test_negative_zeros_are_stored_with_their_sign(tmp_path: Path) -> None:
    w = zoo.mlp()
    step = _compile(w, "numpy")
    name = next(n for n in step.state_names if n.endswith("bias"))
    state = step.state_dict()
    state[name] = np.full_like(state[name], -0.0)
    step.load_state(state)
    folder = step.save(tmp_path / "step")
    assert name not in json.loads((folder / "step.json").read_text())["zeros"]
    back = load_step(folder).state_dict()[name]
    assert np.signbit(back).all()


def test_steps_bound_inside_copies_deferred_share_the_model_until_they_train() -> None:
    w = zoo.mlp()
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    with copies_deferred():
        lent = _compile(w)
    copied = _compile(w)
    trained = lent.trained[0]
    param = dict(w.model.named_parameters())[trained].detach().numpy()
    assert np.shares_memory(lent.flat_state_dict([trained], copy=False)[trained], param)
    assert not np.shares_memory(copied.flat_state_dict([trained], copy=False)[trained], param)
    for k in range(3):
        batch = w.make_batch(1 + k)
        assert lent(*batch) == copied(*batch)
    _equal_state(copied, lent)
    for name, value in w.model.named_parameters():  # the steps never wrote the model
        assert torch.equal(value.detach(), before[name]), name


def test_read_tensors_names_the_damaged_tensor(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    good = {"a": np.arange(4, dtype=np.float32), "b": np.ones(3, np.int64)}
    with path.open("wb") as f:
        write_safetensors_to(f, good)
    assert {k: v.tolist() for k, v in read_tensors(path).items()} == {
        k: v.tolist() for k, v in good.items()
    }
    head = json.loads(header_bytes(good)[8:])
    head["a"]["shape"] = [3]  # 16 bytes for a 12-byte shape
    text = json.dumps(head).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 40)
    with pytest.raises(StepFileError, match=re.escape("t.safetensors: a holds 16 bytes")):
        read_tensors(path)
    path.write_bytes(b"\x10")
    with pytest.raises(
        StepFileError, match=re.escape("t.safetensors: not a whole safetensors file")
    ):
        read_tensors(path)


def _given(model: torch.nn.Module, names: list[str]) -> dict[str, Any]:
    """``names`` as Q8_0 GGUF blocks, used as given."""
    import gguf

    from pockengine.tasks.gguf import decode_blocks

    state = model.state_dict()
    out = {}
    for name in names:
        weight = state[name].numpy()
        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        out[name] = decode_blocks(blocks, "Q8_0", weight.shape)
    return out


def test_stand_ins_for_given_weights_compile_the_same_step() -> None:
    """The compile child replaces the float copies of GGUF-given weights by one-element
    stand-ins before tracing: the step is the same graph, trains the same, and a tied
    weight stays tied (one param under both names)."""
    import copy

    from pockengine.finetune.run_folder.released import stand_in
    from pockengine.ir import print_graph

    w = zoo.llama_lm(layers=1, tied=True)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    given = _given(w.model, names)
    scheme = pe.schemes.select(["*norm*", "*mlp.down_proj*"])

    def compile_(model: torch.nn.Module) -> pe.TrainStep:
        return pe.compile(model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.AdamW(lr=1e-3),
                          scheme=scheme, backend="torch", quantized=given)  # fmt: skip

    kept = copy.deepcopy(w.model)
    freed = stand_in(w.model, names)
    embedding = w.model.get_parameter("model.embed_tokens.weight")
    assert w.model.get_parameter("lm_head.weight") is embedding  # still tied
    assert embedding.untyped_storage().nbytes() == embedding.element_size()
    assert freed == sum(kept.get_parameter(n).numel() * 4 for n in names)
    ours, reference = compile_(w.model), compile_(kept)
    assert print_graph(ours.graph) == print_graph(reference.graph)
    for k in range(3):
        batch = w.make_batch(1 + k)
        assert ours(*batch) == reference(*batch)
    _equal_state(reference, ours)
