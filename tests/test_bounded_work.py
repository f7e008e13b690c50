"""Bounded work on hostile or degenerate input: YAML scheme files with aliases ("billion
laughs") and oversized files, text data whose texts are all empty, ``generate`` past the
model's context. The federated cases are in ``tests/test_federated_bounds.py``."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from pockengine.cli import main
from pockengine.finetune import FinetuneError
from pockengine.ir import SchemeError
from pockengine.sparse import schemes
from pockengine.sparse.scheme_file import MAX_SCHEME_BYTES, shown
from pockengine.tasks import data as ds
from tests.test_finetune_resume import write_task

# -- scheme files ------------------------------------------------------------------------


def _laughs(levels: int = 12) -> str:
    """A YAML "billion laughs": each level a list of nine aliases of the level below, so
    the last one stands for 9**levels strings once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(["scheme: select", *lines, f"train: *l{levels - 1}"]) + "\n"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_billion_laughs_scheme_file_is_refused_fast_and_small(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(_laughs())
    before, start = _peak_rss_mib(), time.perf_counter()
    with pytest.raises(SchemeError) as info:
        schemes.load(path)
    seconds = time.perf_counter() - start
    message = str(info.value)
    assert str(path) in message and "anchor or alias" in message and "line 2" in message
    assert len(message) < 300 and "lol" not in message
    assert seconds < 1.0, seconds
    assert _peak_rss_mib() - before < 50  # the expansion would be 9**12 strings
    # an alias without an anchor of its own line is refused too, from the command line
    alias_only = tmp_path / "alias.yml"
    alias_only.write_text("scheme: select\ntrain: &t ['fc.*']\nfreeze: *t\n")
    with pytest.raises(SchemeError, match=r"alias.yml: line 2, column 8: uses a YAML anchor"):
        schemes.load(alias_only)


def test_a_saved_scheme_with_repeated_parts_loads_back(tmp_path: Path) -> None:
    """A union that repeats a part is written out in full, not with the YAML aliases the
    loader refuses."""
    part = schemes.lora() | schemes.bias_only()
    twice = part | part
    path = tmp_path / "twice.yaml"
    schemes.save(twice, path)
    assert "&" not in path.read_text() and "*id" not in path.read_text()
    assert schemes.load(path).to_dict() == twice.to_dict()


def test_an_oversized_scheme_file_is_refused_reading_no_further(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text('{"scheme": "select", "train": ["' + "x" * MAX_SCHEME_BYTES + '"]}')
    with pytest.raises(SchemeError, match=r"big.json is larger than the 1048576 bytes"):
        schemes.load(path)
    zeros = tmp_path / "zeros.yaml"
    zeros.symlink_to("/dev/zero")  # no end: read up to the cap, no further
    with pytest.raises(SchemeError, match=r"zeros.yaml is larger than the 1048576 bytes"):
        schemes.load(zeros)
    cli = ["inspect", "mlp", "--scheme", str(path)]
    assert main(cli) == 2


def test_scheme_errors_cut_long_values(tmp_path: Path) -> None:
    """A value of the wrong type is quoted cut short, however large or deep it is."""
    nested: Any = "lol" * 1000
    for _ in range(50):
        nested = [nested, "lol" * 100, list(range(100))]  # deep and wide
    for data in ({"scheme": "select", "train": [nested]}, {"scheme": nested},
                 {"scheme": "select", "frozen_bn": "x" * 10_000},
                 {"scheme": "select", "x" * 10_000: 1}):  # fmt: skip
        path = tmp_path / "wrong.json"
        path.write_text(json.dumps(data))
        with pytest.raises(SchemeError) as info:
            schemes.load(path)
        assert str(path) in str(info.value) and len(str(info.value)) < 600, str(info.value)
    shared: Any = "lol"
    for _ in range(50):
        shared = [shared] * 9  # 9**50 strings if walked
    assert len(shown(shared)) < 200


# -- text data ---------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_text_column_empty_in_every_row_never_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    dedupe: bool,
) -> None:  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    options = write_task(tmp_path, rows=40)
    empty = _write(tmp_path / "empty.csv", "review,sentiment\n" + ",pos\n  ,neg\n" * 20)
    out = tmp_path / "run"
    args = ["finetune", "--model", options["model"], "--data", str(empty),
            "--text-column", "review", "--label-column", "sentiment", "--seq-len", "12",
            "--batch-size", "8", "--out", str(out), "--progress", "none"]  # fmt: skip
    assert main(args if dedupe else [*args, "--no-dedupe"]) == 2
    err = capsys.readouterr().err
    assert f"every text in column 'review' of {empty} is empty (40 in all)" in err, err
    assert not (out / "model").exists() and not (out / "checkpoint.safetensors").exists()


def test_empty_texts_are_left_out_and_counted(tmp_path: Path) -> None:
    some = _write(tmp_path / "some.csv", "text,label\n,a\nhi,b\n \t,a\nho,a\n")
    data = ds.load_dataset(some)
    assert data.texts == ("hi", "ho") and data.labels == ("b", "a") and data.empty == 2
    assert data.take([1]).empty == 2
    nulls = _write(tmp_path / "nulls.jsonl", '{"t": null, "y": 1}\n{"t": "", "y": 2}\n')
    with pytest.raises(FinetuneError, match=r"every text in field 't' of .*nulls.jsonl is empty"):
        ds.load_dataset(nulls, "t", "y")
    for label in ("a", "b"):
        (tmp_path / "folder" / label).mkdir(parents=True)
        (tmp_path / "folder" / label / "1.txt").write_text("\n")
    with pytest.raises(FinetuneError, match=r"every file of .*folder is empty \(2 in all\)"):
        ds.load_dataset(tmp_path / "folder")


def test_other_degenerate_data_files_name_the_file(tmp_path: Path) -> None:
    cases = {
        "labels.csv": ("text,label\nhi,\nho, \n", r"labels.csv:2: empty label \(column 'label'\)"),
        "blank.jsonl": ("\n  \n\n", r"dataset .*blank.jsonl is empty"),
        "header.csv": ("text,label\n", r"dataset .*header.csv has a header but no rows"),
        "nolabel.jsonl": ('{"text": "a", "label": null}\n', r"nolabel.jsonl:1: empty label"),
    }
    for name, (text, message) in cases.items():
        with pytest.raises(FinetuneError, match=message):
            ds.load_dataset(_write(tmp_path / name, text))


# -- generate ----------------------------------------------------------------------------


@pytest.fixture
def short_context_run(tmp_path: Path) -> Path:
    """A run folder holding a random 1-layer LLaMA of 32 positions (MiniLM's vocabulary,
    no end-of-text token: only the count or the context stops it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pockengine import zoo
    from pockengine.finetune import FinetuneConfig
    from pockengine.finetune.run_folder.home import META, MODEL_DIR, model_meta

    tokenizer = AutoTokenizer.from_pretrained(str(zoo.minilm_path()), local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "run" / MODEL_DIR
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    ft = FinetuneConfig(recipe="smollm2-pydocs", seq_len=16)
    meta = model_meta({"format": "hf-causal-lm"}, "causal-lm", [], ft, "last", {"step": 0})
    (folder / META).write_text(json.dumps(meta))
    return folder.parent


def test_generate_stops_at_the_models_context_and_says_so(
    short_context_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pockengine as pe
    from pockengine.finetune.trained.generation import generate

    loaded = pe.load_run(short_context_run)
    prompt = "the for statement"
    prompt_tokens = len(loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    new = 32 - prompt_tokens
    assert generate(loaded, prompt, max_new_tokens=100, temperature=0).tokens == new
    command = ["generate", str(short_context_run), "--prompt", prompt, "--temperature", "0"]
    start = time.perf_counter()
    assert main([*command, "--max-new-tokens", "1000000000"]) == 0
    assert time.perf_counter() - start < 60
    err = capsys.readouterr().err
    note = f"note: stopped at the model's context of 32 positions ({prompt_tokens} prompt + {new}"
    assert note in err and "before --max-new-tokens 1000000000" in err, err
    assert f"{new} tokens in" in err and err.count("note:") == 1
    done = generate(loaded, prompt, max_new_tokens=10**9, temperature=0)
    assert done.tokens == new and done.context == 32
    within = generate(loaded, prompt, max_new_tokens=3, temperature=0)
    assert within.tokens == 3 and within.context is None  # the count stopped it: no note
    assert main([*command, "--max-new-tokens", "3"]) == 0
    assert "note:" not in capsys.readouterr().err
    with pytest.raises(FinetuneError, match="the prompt is 40 tokens; the model's context is 32"):
        generate(loaded, " ".join(["word"] * 40), max_new_tokens=1)
    long = ["generate", str(short_context_run), "--prompt", " ".join(["word"] * 32)]
    assert main(long) == 2
    streams = capsys.readouterr()
    assert streams.out == "" and "the prompt is 32 tokens; the model's context is 32" in streams.err
    for bad in ("0", "-5", "abc"):
        assert main([*command, "--max-new-tokens", bad]) == 2
        assert "--max-new-tokens" in capsys.readouterr().err
