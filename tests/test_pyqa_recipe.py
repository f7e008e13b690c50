"""The smollm2-pyqa recipe: question/answer pairs derived from the Python docs, split by name
with a held-out test split no choice reads, trained with the loss on the answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pockengine.cli import main
from pockengine.finetune.compiling import task_step
from pockengine.tasks import instruct_data, recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.instruct_task import pyqa_examples, pyqa_task
from tests.lm_folders import make_tokenizer

STDTYPES = """\
Built-in Types
==============

.. method:: str.split(sep=None, maxsplit=-1)

   Return a list of the words in the string, using *sep* as the delimiter
   string.  If *maxsplit* is given, at most ``maxsplit`` splits are done.  More
   text that is cut.

   Second paragraph, never read.

.. function:: abs(x)

   Return the absolute value of a number.  See :func:`~math.fabs`.
"""

JSONDOC = """\
:mod:`json` --- JSON encoder and decoder
========================================

.. module:: json

.. function:: dumps(obj, *, skipkeys=False, \\
                    indent=None)

   Serialize *obj* to a JSON formatted :class:`str` using this :ref:`conversion
   table <py-to-json-table>`.

.. class:: JSONEncoder(*, skipkipkeys=False)

   Extensible JSON encoder for Python data structures.

   .. method:: encode(o)

      :noindex:

      Return a JSON string representation of a Python data structure, *o*.

.. function:: tiny()

   Short.
"""


def _docs(tmp_path: Path, extra: int = 60) -> list[Path]:
    library = tmp_path / "library"
    library.mkdir()
    (library / "stdtypes.rst.txt").write_text(STDTYPES)
    (library / "json.rst.txt").write_text(JSONDOC)
    many = "".join(f".. function:: helper_{i}(x)\n\n   Return the helper value number {i} of x, "
                   f"as the tests expect.\n\n" for i in range(extra))  # fmt: skip
    (library / "many.rst.txt").write_text(".. module:: many\n\n" + many)
    (tmp_path / "tutorial.rst.txt").write_text(".. function:: outside()\n\n   Not library.\n")
    return sorted(tmp_path.rglob("*.rst.txt"))


def test_pairs_derived_from_entries(tmp_path: Path) -> None:
    pairs = {p.name: p for p in instruct_data.pydocs_pairs(_docs(tmp_path, extra=0))}
    assert set(pairs) == {"str.split", "abs", "json.dumps", "json.JSONEncoder.encode"}
    assert pairs["str.split"].answer == (
        "Return a list of the words in the string, using sep as the delimiter string. "
        "If maxsplit is given, at most `maxsplit` splits are done."
    )
    assert pairs["abs"].answer == "Return the absolute value of a number. See `fabs`."
    assert pairs["json.dumps"].answer == (
        "Serialize obj to a JSON formatted `str` using this `conversion table`."
    )
    assert pairs["json.JSONEncoder.encode"].answer.startswith("Return a JSON string")
    assert pairs["str.split"].record == {"prompt": "What does `str.split` do?",
                                         "completion": pairs["str.split"].answer}  # fmt: skip
    assert pairs["abs"].where.endswith("stdtypes.rst.txt:12")


def _config(**kw: object) -> FinetuneConfig:
    config = FinetuneConfig(recipe="smollm2-pyqa", **kw)  # type: ignore[arg-type]
    return config.with_defaults(recipes.defaults(config)).validate()


def test_test_split_is_fixed_and_held_out(tmp_path: Path) -> None:
    """The held-out split is chosen by name: no seed (or scheme, or learning rate) moves a
    pair into or out of it, and no test pair is in training or validation."""
    files, tok = _docs(tmp_path), make_tokenizer()
    runs = [pyqa_examples(files, tok, _config(seed=s, seq_len=128))[0] for s in (0, 1)]
    texts = [[[tok.decode(e.ids) for e in split] for split in run] for run in runs]
    assert texts[0][2] == texts[1][2] and texts[0][1] == texts[1][1]  # test, validation
    assert texts[0][0] != texts[1][0] and sorted(texts[0][0]) == sorted(texts[1][0])
    assert not set(texts[0][2]) & (set(texts[0][0]) | set(texts[0][1]))
    assert all(len(split) for split in runs[0])


def test_recipe_data_and_one_step(tmp_path: Path) -> None:
    import transformers

    files, tok = _docs(tmp_path), make_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    run = _config(seq_len=128, scheme="sparse", compile_in="process")
    task = pyqa_task(run, files, model, tok)
    ids, seg, _, _, weights = task.train
    assert task.test and len(task.test[0]) > 0
    # the loss covers the answers only: each example's trained tokens decode to its answer
    first = np.flatnonzero(seg[0] == 1)
    answer = tok.decode(ids[0, first[1:]][weights[0, first[:-1]] > 0])
    assert answer.endswith("<|im_end|>\n") and "What does" not in answer
    assert any("held-out test" in n for n in task.notes)
    step = task_step.compile_task(run, task, recipes.parse_scheme("sparse", "smollm2-pyqa"))
    batch = recipes.tensor_rows(task.train, 0, 4)
    assert np.isfinite(step(*batch))


@pytest.mark.slow
def test_pyqa_recipe_runs_on_smollm2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["finetune", "--recipe", "smollm2-pyqa", "--scheme", "lora", "--max-train", "16",
            "--max-val", "8", "--seq-len", "128", "--out", str(out),
            "--progress", "none"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test"]["test_perplexity"] > 1
