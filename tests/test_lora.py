"""LoRA as a scheme: gradients against torch.autograd and PEFT, PEFT-loadable adapters."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import schemes
from pockengine.finetune.run_folder.adapter import load_adapter, save_adapter
from pockengine.ir import SchemeError
from pockengine.sparse.schemes import scheme_named
from pockengine.step.strict_load import StateError
from pockengine.zoo import Workload, bert_classifier, llama_lm

_RANK, _ALPHA = 4, 8


def _llama() -> Workload:
    return llama_lm(layers=1, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq=8, batch=2)


def _bert() -> Workload:
    return bert_classifier(layers=1, hidden=32, heads=4, ffn=48, vocab=64, seq=8, classes=3)


def _random_factors(step: pe.TrainStep, seed: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    """Nonzero A and B for every adapter (B starts at zero, which would hide A's gradient),
    loaded into the step."""
    rng = np.random.default_rng(seed)
    state = step.flat_state_dict()
    factors = {}
    for a in step.resolution.adapters:
        for name in (a.a_name, a.b_name):
            factors[name] = np.asarray(0.3 * rng.standard_normal(state[name].shape), np.float32)
    step.load_state({**state, **factors})
    return factors


class _LoraLinear(nn.Module):
    """The reference: a frozen linear plus scale * (x A^T) B^T, in plain torch."""

    def __init__(self, base: nn.Linear, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.from_numpy(a.copy()))
        self.lora_B = nn.Parameter(torch.from_numpy(b.copy()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = (x @ self.lora_A.T) @ self.lora_B.T
        return self.base(x) + (_ALPHA / _RANK) * delta  # type: ignore[no-any-return]


def _torch_reference(w: Workload, step: pe.TrainStep, factors: dict[str, Any]) -> nn.Module:
    model = copy.deepcopy(w.model)
    for p in model.parameters():
        p.requires_grad_(False)
    for a in step.resolution.adapters:
        parent, _, leaf = a.module.rpartition(".")
        owner = model.get_submodule(parent)
        lora = _LoraLinear(getattr(owner, leaf), factors[a.a_name], factors[a.b_name])
        setattr(owner, leaf, lora)
    return model


def test_lora_gradients_match_torch_autograd() -> None:
    w = _llama()
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, scheme=schemes.lora(_RANK, _ALPHA))
    modules = sorted(a.module for a in step.resolution.adapters)
    projections = ("q_proj", "v_proj")
    assert modules == [f"model.layers.0.self_attn.{p}" for p in projections]
    factors = _random_factors(step)
    got = step.gradients(*batch)
    ref_model = _torch_reference(w, step, factors)
    loss = w.loss_fn(ref_model, *batch)
    loss.backward()
    ref = {
        f"{name}.weight": p.grad.numpy()
        for name, p in ref_model.named_parameters()
        if p.grad is not None
    }
    assert set(got) == set(ref) == set(factors)
    for name, g in got.items():
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
    ref_loss = float(loss.detach())
    assert abs(step(*batch) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))


def test_lora_gradients_match_peft() -> None:
    peft = pytest.importorskip("peft")
    w = _bert()
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, scheme=schemes.lora(_RANK, _ALPHA))
    factors = _random_factors(step, seed=2)
    config = peft.LoraConfig(r=_RANK, lora_alpha=_ALPHA, target_modules=["query", "value"])
    model = peft.get_peft_model(copy.deepcopy(w.model), config)
    peft.set_peft_model_state_dict(
        model, {f"base_model.model.{n}": torch.from_numpy(v) for n, v in factors.items()}
    )
    loss = w.loss_fn(model, *batch)
    loss.backward()
    ref = {
        n.removeprefix("base_model.model.").replace(".default.", "."): p.grad.numpy()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    got = step.gradients(*batch)
    assert set(got) == set(ref)
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_frozen_weights_get_no_gradient_and_no_optimizer_state() -> None:
    w = _llama()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.lora(_RANK, _ALPHA),
                      optimizer=pe.optim.AdamW(lr=1e-2))  # fmt: skip
    adapted = {a.weight for a in step.resolution.adapters}
    before = step.flat_state_dict()
    for i in range(2):
        step(*w.make_batch(i))
    after = step.flat_state_dict()
    grads = [n.outputs[0].name for n in step.graph.nodes if n.phase == "backward"]
    state = step.optimizer_state()
    for weight in adapted:
        np.testing.assert_array_equal(after[weight], before[weight])
        assert not any(weight in s for s in state), weight
    assert grads, "a backward exists"
    trained = set(step.trained)
    assert trained == {n for a in step.resolution.adapters for n in (a.a_name, a.b_name)}
    assert all(any(t in s for s in state) for t in trained)
    assert any(not np.array_equal(after[t], before[t]) for t in trained)
    # B starts at zero: the compiled step starts from the model's own function
    for a in step.resolution.adapters:
        assert not before[a.b_name].any() and before[a.a_name].any()


def test_lora_composes_with_another_scheme_and_round_trips_a_file(tmp_path: Path) -> None:
    w = _bert()
    scheme = schemes.lora(_RANK, _ALPHA, targets=["*query"]) | schemes.bias_only()
    path = tmp_path / "lora.json"
    schemes.save(scheme, path)
    loaded = schemes.load(path)
    assert loaded.to_dict() == scheme.to_dict()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=loaded)
    trained = set(step.trained)
    assert {a.module.rsplit(".", 1)[-1] for a in step.resolution.adapters} == {"query"}
    assert "head.bias" in trained and "encoder.embeddings.LayerNorm.weight" in trained
    assert "head.weight" not in trained
    assert {f"{a.module}.lora_{x}.weight" for a in step.resolution.adapters for x in "AB"} < trained


def test_named_lora_scheme() -> None:
    scheme = scheme_named("lora:16")
    assert scheme.kind == "union"
    parts = scheme.options["schemes"]
    assert parts[0]["scheme"] == "lora" and parts[0]["rank"] == 16 and parts[0]["alpha"] == 32
    assert parts[1]["scheme"] == "head"
    assert scheme_named("lora", lora_head=False).to_dict()["rank"] == 8


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        (schemes.lora(targets=["*nothing"]), "matches no linear layer"),
        (schemes.lora(rank=0), "rank"),
        (schemes.lora(dropout=0.1), "dropout"),
    ],
)
def test_bad_lora_schemes_are_scheme_errors(scheme: schemes.Scheme, message: str) -> None:
    from pockengine.frontend.torch import torch_model_info

    with pytest.raises(SchemeError, match=message):
        scheme.resolve(torch_model_info(_llama().model))


@pytest.mark.parametrize(
    ("config", "kw", "want"),
    [
        ("DebertaV2Config", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                             "intermediate_size": 64, "vocab_size": 50},
         ["query_proj", "value_proj"]),
        ("BloomConfig", {"hidden_size": 32, "n_layer": 1, "n_head": 4, "vocab_size": 50},
         ["query_key_value"]),
    ],
)  # fmt: skip
def test_default_targets_of_other_families(
    config: str, kw: dict[str, Any], want: list[str]
) -> None:
    """PEFT's default modules where the family names its projections its own way."""
    transformers = pytest.importorskip("transformers")
    from pockengine.frontend.torch import torch_model_info

    model = transformers.AutoModel.from_config(getattr(transformers, config)(**kw))
    names = schemes.lora().resolve(torch_model_info(model)).names
    adapted = {n.rsplit(".", 3)[-3] for n in names if "lora_A" in n}
    assert adapted == set(want)


def test_saved_adapter_loads_into_peft_with_the_same_logits(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    w = _bert()
    scheme = schemes.lora(_RANK, _ALPHA) | schemes.head()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme,
                      optimizer=pe.optim.AdamW(lr=1e-2))  # fmt: skip
    for i in range(3):
        step(*w.make_batch(i))
    folder = save_adapter(step, tmp_path / "adapter")
    assert folder is not None
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == _RANK and config["modules_to_save"] == ["head"]
    merged = copy.deepcopy(w.model).eval()
    step.load_into(merged)  # adapters folded into the frozen weights
    batch = w.make_batch(5)
    ours = step(*batch)  # the loss of the forward before this step's update
    model = peft.PeftModel.from_pretrained(copy.deepcopy(w.model), str(folder))
    model.eval()
    with torch.no_grad():
        peft_logits = model(*batch[:-1])
        np.testing.assert_allclose(peft_logits, merged(*batch[:-1]), rtol=1e-4, atol=1e-5)
        assert abs(float(w.loss_fn(model, *batch)) - ours) < 1e-4


def test_load_adapter_restores_a_step(tmp_path: Path) -> None:
    w = _llama()
    scheme = schemes.lora(_RANK, _ALPHA)
    trained = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme)
    factors = _random_factors(trained, seed=3)
    save_adapter(trained, tmp_path)
    fresh = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme)
    result = load_adapter(fresh, tmp_path)
    assert not result.unexpected and not result.mismatched
    state = fresh.flat_state_dict()
    for name, value in factors.items():
        np.testing.assert_array_equal(state[name], value)
    other = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.lora(_RANK * 2))
    with pytest.raises(StateError, match="does not fit"):
        load_adapter(other, tmp_path)


def test_lora_on_int8_frozen_weights_matches_the_dequantized_model() -> None:
    """QLoRA: adapters over low-bit frozen weights get the gradients a float step gets on
    the dequantized weights."""
    w = _llama()
    batch = w.make_batch(0)
    scheme = schemes.lora(_RANK, _ALPHA)
    low = pe.compile(w.model, w.loss_fn, batch, scheme=scheme, frozen_dtype="int8")
    assert "i8" in str(low.report())  # the adapted (frozen) weights are stored as int8
    factors = _random_factors(low, seed=4)
    dequantized = low.flat_state_dict()
    model = copy.deepcopy(w.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(dequantized[name]))
    ref = pe.compile(model, w.loss_fn, batch, scheme=scheme)
    ref.load_state({**ref.flat_state_dict(), **factors})
    got, want = low.gradients(*batch), ref.gradients(*batch)
    assert set(got) == set(want) == set(factors)
    for name, g in got.items():
        np.testing.assert_allclose(g, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_finetune_with_scheme_lora_writes_a_peft_adapter(tmp_path: Path) -> None:
    """``pockengine finetune --scheme lora`` on a tiny BERT folder: RUN/adapter/ holds the
    query/value adapters and the new head, and loads back into the run's step."""
    from tests.test_finetune_resume import write_task
    from tests.test_hostile import tiny_bert

    task = write_task(tmp_path, module="unused_factory")
    model = tiny_bert(tmp_path / "bert")
    task.update(model=str(model), max_train=16, epochs=1, scheme="lora", keep="last")
    result = pe.finetune(**task, out=str(tmp_path / "run"))
    assert result.finished
    folder = tmp_path / "run" / "adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert config["target_modules"] == [
        "encoder.encoder.layer.0.attention.self.query",
        "encoder.encoder.layer.0.attention.self.value",
    ]
    assert config["modules_to_save"] == ["head"]
    trained = result.step.flat_state_dict()
    assert any(trained[n].any() for n in trained if n.endswith("lora_B.weight"))  # B moved
    assert load_adapter(result.step, folder).unexpected == ()
    for name, value in result.step.flat_state_dict().items():
        np.testing.assert_array_equal(value, trained[name])
