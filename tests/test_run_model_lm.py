"""After a causal-LM run: RUN/model loads in transformers with the trained weights,
``pockengine generate`` streams what ``model.generate`` would (greedy), sampling is seeded,
``pockengine evaluate`` repeats the run's validation. A tiny random LLaMA stands in for
SmolLM2 in the smollm2-pydocs recipe; the real model runs under ``slow``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from pockengine.finetune.trained.generation import generate
from pockengine.tasks import causal_lm
from tests.test_run_model import _run


def _run_lm(out: Path, *options: str) -> None:
    """A few chunks of the smollm2-pydocs recipe, four a batch."""
    _run(out, "--recipe", "smollm2-pydocs", "--batch-size", "4", "--max-train", "8",
         "--max-val", "4", *options)  # fmt: skip


@pytest.fixture
def tiny_llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A random 2-layer LLaMA with MiniLM's vocabulary ([SEP] as end-of-text) standing in
    for SmolLM2 in the smollm2-pydocs recipe."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "tiny-llama"
    tokenizer = AutoTokenizer.from_pretrained(str(zoo.minilm_path()), local_files_only=True)
    tokenizer.eos_token = "[SEP]"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    monkeypatch.setattr(causal_lm, "smollm2_folder", lambda: folder)
    yield folder


def test_causal_lm_loads_generates_and_evaluates(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lm"
    # the stand-in model is patched into this process only: compile here
    _run_lm(out, "--scheme", "full", "--lr", "0.01", "--seq-len", "16", "--compile-in", "process")
    _check_causal_lm(out, capsys)


@pytest.mark.slow
def test_smollm2_run_loads_generates_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real SmolLM2-135M (the recipe's default sparse scheme), a few chunks."""
    out = tmp_path / "smollm2"
    _run_lm(out, "--seq-len", "32")
    _check_causal_lm(out, capsys)


def _check_causal_lm(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "model"), local_files_only=True)
    saved = checkpoint.load(out / checkpoint.CHECKPOINT).params
    state = model.state_dict()
    for name, array in saved.items():
        np.testing.assert_array_equal(state[name].numpy(), array, err_msg=name)
    loaded = pe.load_run(out)
    prompt = "The for statement"
    ids = loaded.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    want = loaded.tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
    capsys.readouterr()
    command = ["generate", str(out), "--prompt", prompt, "--max-new-tokens", "6"]
    assert main([*command, "--temperature", "0"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == prompt + want + "\n" and "tokens/s" in streamed.err
    sampled = [generate(loaded, prompt, max_new_tokens=8, seed=s).text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert main(["evaluate", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    final = json.loads((out / "summary.json").read_text())["final"]
    # the run validated through its compiled evaluator (the fused, chunked loss), evaluate
    # runs the model eagerly: the same weights, float32 sums in another order
    assert result["loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    assert result["perplexity"] == pytest.approx(final["val_perplexity"], rel=1e-5)
    with pytest.raises(pe.FinetuneError, match="causal language model"):
        loaded.predict(["a text"])
