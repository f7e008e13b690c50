"""LoRA adapters for llama.cpp: ``pockengine export RUN --target gguf-lora`` (and ``peft``).

The written file reads back with ``gguf.GGUFReader``: llama.cpp's adapter metadata
(``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, the LLaMA
architecture), a ``.lora_a``/``.lora_b`` pair per adapted weight under the LLaMA GGUF name,
with GGUF's shapes (``[in, r]`` and ``[r, out]``), and the values of the run's trained
factors (the query and key B rows in llama.cpp's order: un-permuting them, as the GGUF
reader does for weights, gives the run's B). A ``./train --save`` file's factors replace
the run's; runs that train more than LoRA factors, and sources that are not LoRA runs, are
one clear error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c.export import write_safetensors
from pockengine.cli import main
from pockengine.finetune.run_folder.adapter import save_adapter
from pockengine.finetune.trained.gguf_lora import lora_pairs
from pockengine.ops.quant import Quantized
from pockengine.tasks.gguf import _rows_permuted

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
_HEADS, _KV_HEADS = 4, 2
_TARGETS = ["*q_proj", "*k_proj", "*v_proj", "*down_proj"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run folder as a --scheme lora fine-tune leaves it (RUN/adapter, RUN/model's config)
    after two AdamW steps, so every B factor is non-zero; and the step's factors."""
    w = zoo.llama_lm(layers=2, heads=_HEADS, kv_heads=_KV_HEADS)
    scheme = pe.schemes.lora(rank=4, alpha=8, targets=_TARGETS)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme, backend="numpy",
                      optimizer=pe.optim.AdamW(lr=1e-2), compile_in="process")  # fmt: skip
    for i in range(2):
        step(*w.make_batch(i))
    run = tmp_path_factory.mktemp("lora") / "run"
    run.mkdir()
    save_adapter(step, run / "adapter")
    w.model.config.save_pretrained(run / "model")
    return run, lora_pairs(step.state_dict())


def _read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {}
    for name, field in reader.fields.items():
        value = field.parts[field.data[0]] if field.data else None
        if value is not None and value.dtype == np.uint8:
            fields[name] = bytes(value).decode()
        elif value is not None:
            fields[name] = value[0]
    return fields, {t.name: t for t in reader.tensors}


def _unpermuted(b: Array, heads: int) -> Array:
    """What tasks/gguf.py does to a GGUF query/key weight's rows, on B."""
    return _rows_permuted(Quantized(b, b, None, "int8", 2), heads).codes


def test_gguf_lora_has_llama_cpps_metadata_names_shapes_and_the_runs_factors(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, pairs = lora_run
    out = tmp_path / "gguf"
    assert main(["export", str(run), "--target", "gguf-lora", "-o", str(out)]) == 0
    fields, tensors = _read(out / "adapter.gguf")
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama"
    assert fields["adapter.lora.alpha"] == pytest.approx(8.0)
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "down_proj": "ffn_down"}
    want = {f"blk.{i}.{g}.weight.lora_{x}" for i in range(2) for g in parts.values() for x in "ab"}
    assert set(tensors) == want and len(pairs) == 8
    for module, (a, b) in pairs.items():
        layer, kind = module.split(".")[2], module.split(".")[-1]
        name = f"blk.{layer}.{parts[kind]}.weight"
        ta, tb = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        assert list(ta.shape) == [a.shape[1], 4] and list(tb.shape) == [4, b.shape[0]]
        np.testing.assert_array_equal(np.asarray(ta.data).reshape(a.shape), a)
        got_b = np.asarray(tb.data).reshape(b.shape)
        if kind in ("q_proj", "k_proj"):
            assert not np.array_equal(got_b, b)  # llama.cpp's row order
            got_b = _unpermuted(got_b, _HEADS if kind == "q_proj" else _KV_HEADS)
        assert np.abs(b).max() > 0
        np.testing.assert_array_equal(got_b, b)


def test_a_train_state_files_factors_replace_the_runs(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, pairs = lora_run
    module = "model.layers.1.self_attn.v_proj"
    a, b = pairs[module]
    state = tmp_path / "trained.safetensors"
    write_safetensors(state, {f"{module}.lora_A.weight": a + 1, f"{module}.lora_B.weight": b * 2,
                              "model.norm.weight": np.ones(4, np.float32)})  # fmt: skip
    out = tmp_path / "gguf"
    args = ["export", str(run), "--target", "gguf-lora", "--state", str(state), "-o", str(out)]
    assert main(args) == 0
    _, tensors = _read(out / "adapter.gguf")
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_v.weight.lora_a"].data), a + 1)
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_v.weight.lora_b"].data), b * 2)
    q = pairs["model.layers.1.self_attn.q_proj"][0]
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_q.weight.lora_a"].data), q)
    peft = tmp_path / "peft"
    args = ["export", str(run), "--target", "peft", "--state", str(state), "-o", str(peft)]
    assert main(args) == 0
    back = lora_pairs(pe.backends.c.read_safetensors(peft / "adapter_model.safetensors"))
    np.testing.assert_array_equal(back[module][1], b * 2)
    assert (peft / "adapter_config.json").read_bytes() == (
        run / "adapter" / "adapter_config.json"
    ).read_bytes()


def test_what_is_not_a_lora_run_is_one_clear_error(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = lora_run
    plain = tmp_path / "plain"
    (plain / "adapter").mkdir(parents=True)
    assert main(["export", str(plain), "--target", "gguf-lora", "-o", str(tmp_path / "o")]) != 0
    assert "has no LoRA adapter" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.safetensors"
    write_safetensors(bad, {"w": np.zeros(2, np.float32)})
    args = ["export", str(run), "--target", "peft", "--state", str(bad), "-o", str(tmp_path / "p")]
    assert main(args) != 0
    assert "holds no LoRA factors" in capsys.readouterr().err
    headed = tmp_path / "headed"
    shutil.copytree(run, headed)
    config = json.loads((headed / "adapter" / "adapter_config.json").read_text())
    config["modules_to_save"] = ["lm_head"]
    (headed / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    assert main(["export", str(headed), "--target", "gguf-lora", "-o", str(tmp_path / "h")]) != 0
    assert "also trains lm_head" in capsys.readouterr().err


def _edited(run: Path, into: Path, config: dict[str, Any] | None = None,
            adapter: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """A copy of ``run`` with keys of RUN/model/config.json and RUN/adapter's config set."""
    shutil.copytree(run, into)
    for path, keys in ((into / "model" / "config.json", config),
                       (into / "adapter" / "adapter_config.json", adapter)):  # fmt: skip
        data = json.loads(path.read_text())
        data.update(keys or {})
        path.write_text(json.dumps(data))
    return into


def test_the_metadata_has_the_types_llama_cpp_reads(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """llama.cpp reads ``general.type``, ``general.architecture`` and ``adapter.type`` as
    strings and ``adapter.lora.alpha`` with ``gguf_get_val_f32``, which asserts a FLOAT32
    value (src/llama-adapter.cpp:166-192, ggml/src/gguf.cpp:866-869 and its ``get_val``'s
    type assert at :183, llama.cpp 4227c9be as llama-cpp-python 0.3.16 vendors it); it
    pairs tensors by the ``.lora_a``/``.lora_b`` suffixes (:227-245) and wants A's ne[0] to
    be the weight's ne[0] and A's ne[1] B's ne[0] (:316-321); the factors are F32."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    run, _ = lora_run
    assert main(["export", str(run), "--target", "gguf-lora", "-o", str(tmp_path / "o")]) == 0
    reader = GGUFReader(str(tmp_path / "o" / "adapter.gguf"))
    types = {name: field.types for name, field in reader.fields.items()}
    assert types["adapter.lora.alpha"] == [GGUFValueType.FLOAT32]
    for key in ("general.type", "general.architecture", "adapter.type"):
        assert types[key] == [GGUFValueType.STRING]
    assert {t.tensor_type for t in reader.tensors} == {GGMLQuantizationType.F32}
    for t in reader.tensors:
        if t.name.endswith(".lora_a"):
            b = next(u for u in reader.tensors if u.name == t.name[:-1] + "b")
            assert t.shape[1] == b.shape[0] == 4  # ne: A [in, r], B [r, out]


def test_qwen_adapters_name_llama_cpps_architecture_and_keep_the_row_order(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """llama.cpp refuses an adapter whose ``general.architecture`` is not the base model's
    (src/llama-adapter.cpp:181-185): a Qwen2 GGUF says ``qwen2``. And its converter permutes
    the query/key rows only for LlamaModel (convert_hf_to_gguf.py:1952-1954 undo_permute,
    applied at :2108-2112); Qwen2Model (:2891) and Qwen3Model (:3591) do not, so the
    adapter's B rows stay in Hugging Face's order."""
    run, pairs = lora_run
    for arch, name in (("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")):
        qwen = _edited(run, tmp_path / name, config={"architectures": [arch]})
        assert main(["export", str(qwen), "--target", "gguf-lora", "-o", str(qwen / "o")]) == 0
        fields, tensors = _read(qwen / "o" / "adapter.gguf")
        assert fields["general.architecture"] == name
        for layer in range(2):
            for kind, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
                b = pairs[f"model.layers.{layer}.self_attn.{kind}"][1]
                got = np.asarray(tensors[f"blk.{layer}.{gg}.weight.lora_b"].data)
                np.testing.assert_array_equal(got.reshape(b.shape), b)
    mistral = _edited(run, tmp_path / "mistral", config={"architectures": ["MistralForCausalLM"]})
    assert main(["export", str(mistral), "--target", "gguf-lora", "-o", str(mistral / "o")]) == 0
    assert _read(mistral / "o" / "adapter.gguf")[0]["general.architecture"] == "llama"


def test_rslora_and_per_module_alphas_give_peft_s_product_at_llama_cpps_scale(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """llama.cpp scales each pair by ``alpha / rank`` with rank B's ne[0]
    (src/llama-adapter.h:51-53, used at src/llama-graph.cpp:555); PEFT by ``alpha / r``, or
    ``alpha / sqrt(r)`` with ``use_rslora``: B carries the difference."""
    run, pairs = lora_run
    module = "model.layers.0.self_attn.v_proj"
    rs = _edited(run, tmp_path / "rs", adapter={"use_rslora": True, "alpha_pattern": {module: 2.0}})
    assert main(["export", str(rs), "--target", "gguf-lora", "-o", str(rs / "o")]) == 0
    fields, tensors = _read(rs / "o" / "adapter.gguf")
    alpha, rank = float(fields["adapter.lora.alpha"]), 4
    for m, own in ((module, 2.0), ("model.layers.1.self_attn.v_proj", 8.0)):
        a, b = pairs[m]
        layer = m.split(".")[2]
        got_a = np.asarray(tensors[f"blk.{layer}.attn_v.weight.lora_a"].data).reshape(a.shape)
        got_b = np.asarray(tensors[f"blk.{layer}.attn_v.weight.lora_b"].data).reshape(b.shape)
        np.testing.assert_allclose(
            alpha / rank * got_b @ got_a, own / np.sqrt(rank) * b @ a, rtol=1e-5, atol=1e-7
        )


def test_what_llama_cpp_cannot_load_is_refused_before_anything_is_written(
    lora_run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An architecture without known GGUF names; DoRA (magnitude vectors llama.cpp has no
    place for); LoRA on a head tied to the embedding, which the GGUF does not store
    (llama.cpp: src/llama-adapter.cpp:284-287 'does not exist in base model'; its own
    converter refuses it too, convert_lora_to_gguf.py:419-424)."""
    run, pairs = lora_run
    gemma = _edited(run, tmp_path / "gemma", config={"architectures": ["Gemma2ForCausalLM"]})
    dora = _edited(run, tmp_path / "dora", adapter={"use_dora": True})
    tied = _edited(run, tmp_path / "tied", config={"tie_word_embeddings": True})
    a, b = pairs["model.layers.0.self_attn.v_proj"]
    weights = tied / "adapter" / "adapter_model.safetensors"
    tensors = dict(pe.backends.c.read_safetensors(weights))
    tensors["base_model.model.lm_head.lora_A.weight"] = a
    tensors["base_model.model.lm_head.lora_B.weight"] = np.zeros((b.shape[0] * 2, 4), np.float32)
    write_safetensors(weights, tensors)
    for folder, message in ((gemma, "of a Gemma2ForCausalLM model is not written"),
                            (dora, "a DoRA adapter"), (tied, "ties to the embedding")):  # fmt: skip
        out = tmp_path / f"{folder.name}-out"
        assert main(["export", str(folder), "--target", "gguf-lora", "-o", str(out)]) != 0
        assert message in capsys.readouterr().err
        assert not out.exists()
