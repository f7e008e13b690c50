"""Fine-tuning your own causal LM: the data kinds and their masks (``lm_data``), packing
(``lm_pack``), the exactness of packed training against the examples one by one in eager
PyTorch with prompt labels at -100 (LLaMA and Qwen2), bad input as one error naming the
file and line, and a whole ``pockengine finetune --model DIR --data FILE`` run."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.cli import main
from pockengine.finetune.trained.lm_chat import end_of_turn
from pockengine.tasks import lm_data, lm_pack
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.lm_kind import wants_lm
from pockengine.tasks.lm_task import build_lm_task
from tests.lm_folders import make_lm_folder, make_tokenizer, write_llama_gguf

CHATS = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "how do I sort?"},
                  {"role": "assistant", "content": "use sorted"},
                  {"role": "user", "content": "and in place?"},
                  {"role": "assistant", "content": "xs.sort()"}]},
    {"messages": [{"role": "user", "content": "hello"},
                  {"role": "assistant", "content": "hello there"}]},
    {"prompt": "the cat sat", "completion": " on the mat"},
    {"instruction": "say hello", "input": "my friend", "output": "hello my friend"},
]  # fmt: skip


def _write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _examples(tmp_path: Path, tok: Any, seq_len: int = 64) -> list[lm_data.LMExample]:
    out = []
    for i, record in enumerate(CHATS):
        out += lm_data.load_lm_data(_write(tmp_path / f"{i}.jsonl", [record]), tok,
                                    seq_len).examples  # fmt: skip
    return out


def test_chat_rendered_by_template_with_assistant_tokens_trained(tmp_path: Path) -> None:
    tok = make_tokenizer()
    data = lm_data.load_lm_data(_write(tmp_path / "c.jsonl", CHATS[:1]), tok, 128)
    assert data.kind == "chat"
    ex = data.examples[0]
    text = tok.decode(ex.ids)
    assert text == lm_data.render(tok, CHATS[0]["messages"], False)
    assert tok.decode(ex.ids[ex.trained]) == "use sorted<|im_end|>\nxs.sort()<|im_end|>\n"
    every = lm_data.load_lm_data(tmp_path / "c.jsonl", tok, 128, train_on_prompt=True)
    assert every.examples[0].trained.all()


def test_kinds_detected_and_plain_template_without_one(tmp_path: Path) -> None:
    tok = make_tokenizer(chat_template=None)
    kinds = {}
    for i, record in enumerate([*CHATS[1:], {"text": "the cat sat"}]):
        data = lm_data.load_lm_data(_write(tmp_path / f"{i}.jsonl", [record]), tok, 128)
        kinds[data.kind] = data.examples[0]
    assert set(kinds) == {"chat", "completion", "alpaca", "text"}
    alpaca = kinds["alpaca"]
    assert tok.decode(alpaca.ids) == (
        "### User:\nsay hello\n\nmy friend\n\n### Assistant:\nhello my friend<|endoftext|>"
    )
    assert tok.decode(alpaca.ids[alpaca.trained]) == "hello my friend<|endoftext|>"
    assert kinds["text"].trained.all()
    assert kinds["text"].ids[-1] == tok.eos_token_id


def test_raw_text_folder_chunked(tmp_path: Path) -> None:
    tok = make_tokenizer()
    (tmp_path / "notes").mkdir()
    for i in range(3):
        (tmp_path / "notes" / f"{i}.md").write_text("the cat sat on the mat " * 10)
    data = lm_data.load_lm_data(tmp_path / "notes", tok, 16)
    assert data.kind == "text" and all(len(e.ids) == 16 and e.trained.all()
                                       for e in data.examples)  # fmt: skip


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"text": "ok"}, {"prompt": "q"}], r":2: no \"text\" key"),
        ([{"question": "q", "answer": "a"}], r":1: keys \['answer', 'question'\] name no"),
        ([{"prompt": "q", "completion": "  "}], r':1: "completion" is empty'),
        ([{"messages": [{"role": "user", "content": "hi"}]}], ":1: the chat has no assistant"),
        ([{"messages": [{"role": "bot", "content": "hi"}]}], r':1: "messages"\[0\]: role .bot.'),
        ([{"prompt": "q", "completion": "a " * 80}], ":1: the example is .* longer than"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, records: list[Any], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(FinetuneError, match=f"{tmp_path}/bad.jsonl{message}"):
        lm_data.load_lm_data(path, make_tokenizer(), 32, truncate=False)


def test_template_that_rewrites_earlier_turns_refused(tmp_path: Path) -> None:
    """A template that drops earlier assistant turns once a later one is added (as some
    reasoning models' templates drop earlier thoughts) cannot be cut into turns."""
    last_only = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] }}: {{ m['content'] }}|{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    path = _write(tmp_path / "c.jsonl", CHATS[:1])
    with pytest.raises(FinetuneError, match=r"c.jsonl:1: the chat template does not render"):
        lm_data.load_lm_data(path, make_tokenizer(chat_template=last_only), 128)


def test_truncated_with_a_count(tmp_path: Path) -> None:
    records = [{"prompt": "q", "completion": "a " * 80}, {"prompt": "a " * 80, "completion": "b"}]
    data = lm_data.load_lm_data(_write(tmp_path / "long.jsonl", records), make_tokenizer(), 32)
    assert (data.truncated, data.dropped, len(data.examples)) == (2, 1, 1)
    assert len(data.examples[0].ids) == 32


def test_packing_keeps_examples_apart(tmp_path: Path) -> None:
    tok = make_tokenizer()
    examples = _examples(tmp_path, tok) * 3
    (ids, seg, pos, targets, weights), stats = lm_pack.pack_examples(examples, 64, 0)
    assert stats.tokens == sum(len(e.ids) for e in examples)
    assert stats.padded_share == pytest.approx(1 - stats.tokens / ids.size)
    assert stats.trained == int(sum(e.trained[1:].sum() for e in examples)) == weights.sum()
    for r in range(len(ids)):  # each segment is one example, its positions from 0
        for s in range(1, seg[r].max() + 1):
            at = np.flatnonzero(seg[r] == s)
            assert np.array_equal(pos[r, at], np.arange(len(at)))
            assert np.array_equal(targets[r, at[:-1]], ids[r, at[1:]])
            assert weights[r, at[-1]] == 0  # the last token predicts nothing of its example
    _, unpacked = lm_pack.pack_examples(examples, 64, 0, packing=False)
    assert stats.rows < unpacked.rows and stats.padded_share < unpacked.padded_share


def _tiny(arch: str) -> torch.nn.Module:
    import transformers

    tok = make_tokenizer()
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_step_equals_examples_one_by_one(tmp_path: Path, arch: str) -> None:
    """Loss and every gradient of a packed batch = the examples run one by one in eager
    torch with labels -100 on the prompt tokens, summed and divided by the trained tokens."""
    tok = make_tokenizer()
    model = _tiny(arch)
    examples = _examples(tmp_path, tok)
    arrays, stats = lm_pack.pack_examples(examples, 96, tok.pad_token_id)
    assert stats.rows < len(examples)  # several examples share a row
    batch = tuple(torch.from_numpy(a) for a in arrays)
    step = pe.compile(model, lm_pack.packed_lm_loss, batch, backend="torch", compile_in="process")
    grads = step.gradients(*batch)
    total = torch.zeros(())
    for ex in examples:
        ids = torch.from_numpy(ex.ids)[None]
        labels = torch.where(torch.from_numpy(ex.trained), ids[0], -100)[None]
        out = model(input_ids=ids, labels=labels, use_cache=False)
        total = total + out.loss * int(ex.trained[1:].sum())
    model.zero_grad()
    (total / stats.trained).backward()
    loss = step(*batch)
    assert float(loss) == pytest.approx(float(total.detach()) / stats.trained, rel=1e-5)
    for name, p in model.named_parameters():
        assert p.grad is not None
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_packed_and_padded_rows_compile_one_step(tmp_path: Path) -> None:
    """Packed rows and rows of one example padded to the length compile the same step: the
    block-diagonal mask is built inside it from the integer segments and positions, never
    differentiated (attention's fused backward, not its explicit VJP) and never a float
    [rows, heads, L, L] value, so a packed step costs what a pad-to-max step does."""
    tok = make_tokenizer()
    examples = _examples(tmp_path, tok)
    graphs = []
    for packing in (True, False):
        arrays, _ = lm_pack.pack_examples(examples, 96, tok.pad_token_id, packing=packing)
        batch = tuple(torch.from_numpy(a[:2].copy()) for a in arrays)
        step = pe.compile(_tiny("llama"), lm_pack.packed_lm_loss, batch, backend="torch",
                          compile_in="process")  # fmt: skip
        graphs.append(step.graph)
    assert str(graphs[0]) == str(graphs[1])
    ops = [n.op for n in graphs[0].nodes]
    assert ops.count("attention") == ops.count("attention_grad") == 2  # one a layer
    heads = 4  # _tiny's
    assert not [v for n in graphs[0].nodes for v in n.outputs
                if v.shape == (2, heads, 96, 96) and v.dtype.is_float]  # fmt: skip


def _config(model: Path, data: Path, **kw: Any) -> FinetuneConfig:
    return FinetuneConfig(recipe=None, model=str(model), data=str(data), seq_len=64,
                          batch_size=2, **kw).validate()  # fmt: skip


def test_hf_folder_and_gguf_file_give_the_same_losses(tmp_path: Path) -> None:
    folder = make_lm_folder(tmp_path / "tiny")
    gguf_file = write_llama_gguf(folder, tmp_path / "tiny.gguf")
    data = _write(tmp_path / "chat.jsonl", CHATS[:2] * 4)
    tasks = [build_lm_task(_config(m, data)) for m in (folder, gguf_file)]
    assert all(wants_lm(_config(m, data)) for m in (folder, gguf_file))
    for a, b in zip(tasks[0].train, tasks[1].train, strict=True):
        np.testing.assert_array_equal(a, b)  # the same tokens, template and masks
    batch = tuple(torch.from_numpy(a) for a in tasks[0].train)
    with torch.no_grad():
        hf, gg = (float(lm_pack.packed_lm_loss(t.model, *batch)) for t in tasks)
    assert gg == pytest.approx(hf, rel=1e-6)


def test_gguf_blocks_kept_as_frozen_weights(tmp_path: Path) -> None:
    """``--frozen-dtype gguf`` on a user's LLaMA GGUF file: the Q8_0 blocks of every block
    matrix, unpermuted to the model's rows, dequantize to the weights transformers loads."""
    from pockengine.ops.quant import dequantize_array
    from pockengine.tasks.gguf import frozen_weights

    gguf_file = write_llama_gguf(make_lm_folder(tmp_path / "tiny"), tmp_path / "q8.gguf", q8=True)
    data = _write(tmp_path / "chat.jsonl", CHATS[:2] * 4)
    config = _config(gguf_file, data, frozen_dtype="gguf")
    blocks = frozen_weights(config).given
    model = build_lm_task(config).model
    state = model.state_dict()
    assert len(blocks) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    for name, q in blocks.items():
        w = dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme, group=q.group)
        np.testing.assert_allclose(w, state[name].numpy(), atol=1e-6)


def test_models_that_are_no_causal_lm_refused(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "enc.gguf"), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = _write(tmp_path / "chat.jsonl", CHATS[:2])
    with pytest.raises(FinetuneError, match=r"enc.gguf: GGUF architecture 'bert' is not one"):
        build_lm_task(_config(tmp_path / "enc.gguf", data))
    folder = make_lm_folder(tmp_path / "tiny")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    assert not wants_lm(_config(folder, data))
    with pytest.raises(FinetuneError, match=r"tiny: not a causal LM"):
        build_lm_task(_config(folder, data, task="lm"))


def test_end_of_turn_is_the_templates_special_token() -> None:
    chatml, plain = make_tokenizer(), make_tokenizer(chat_template=None)
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn(chatml) == {chatml.eos_token_id, im_end}
    assert end_of_turn(plain) == {plain.eos_token_id}


def test_finetune_own_chat_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_lm_folder(tmp_path / "tiny")
    data = _write(tmp_path / "chat.jsonl", CHATS[:2] * 8)
    out = tmp_path / "run"
    args = ["finetune", "--model", str(folder), "--data", str(data), "--seq-len", "64",
            "--batch-size", "2", "--epochs", "1", "--scheme", "sparse", "--out", str(out),
            "--progress", "none", "--compile-in", "process"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "packed into" in printed and "% padding" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["val_perplexity"] > 1
    assert (out / "model" / "model.safetensors").is_file()
    # the LLM rule (norms, o_proj, down_proj): the pretrained output projection stays frozen
    model_config = json.loads((folder / "config.json").read_text())
    head = model_config["vocab_size"] * model_config["hidden_size"]
    assert 0 < summary["trained_params"] < head
    # pockengine evaluate repeats the run's validation: packed, trained tokens only
    assert main(["evaluate", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["loss"] == pytest.approx(summary["final"]["val_loss"], rel=1e-5)
    assert main(["evaluate", str(out), "--data", str(data)]) == 0
    assert json.loads((out / "eval.json").read_text())["tokens"] > result["tokens"]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("how do I sort?\n\nand in place?\n"))
    chat = ["generate", str(out), "--chat", "--max-new-tokens", "4", "--temperature", "0"]
    assert main(chat) == 0
    assert "2 replies" in capsys.readouterr().err
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    bad = _write(tmp_path / "bad.jsonl", [*CHATS[:2], user_only])
    assert main([*args[:4], str(bad), *args[5:-6], "--out", str(tmp_path / "no")]) != 0
    assert f"{bad}:3: the chat has no assistant turn" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_compiled_evaluation_applies_lora_adapters(tmp_path: Path) -> None:
    """The compiled evaluation of a LoRA step computes what the adapted step does: after a
    few updates, its loss equals the eager model with the adapters merged in (before the
    fix it evaluated the base weights, as if nothing had trained)."""
    tok = make_tokenizer()
    model = _tiny("llama")
    arrays, _ = lm_pack.pack_examples(_examples(tmp_path, tok), 96, tok.pad_token_id)
    batch = tuple(torch.from_numpy(a) for a in arrays)
    step = pe.compile(model, lm_pack.packed_lm_loss, batch, optimizer=pe.optim.SGD(lr=5.0),
                      scheme=pe.schemes.lora(rank=4), backend="torch",
                      compile_in="process")  # fmt: skip
    rows = torch.ones(len(batch[0]))
    evaluator = step.evaluator(model, lm_pack.packed_lm_eval, (*batch, rows))
    with torch.no_grad():
        base = lm_pack.packed_lm_eval(model, *batch, rows).numpy()
    for _ in range(3):
        step(*batch)
    ours = np.asarray(evaluator(*(a.numpy() for a in batch), rows.numpy()))
    step.load_into(model)  # the adapters merged into q_proj and v_proj
    with torch.no_grad():
        eager = lm_pack.packed_lm_eval(model, *batch, rows).numpy()
    assert abs(eager[0] - base[0]) > 1e-3 * abs(base[0])  # the adapters changed the loss
    np.testing.assert_allclose(ours, eager, rtol=1e-5)
