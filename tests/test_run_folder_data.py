"""A run folder is data: nothing read from it names code to run.

A tiny ``module:factory`` run is trained once; its ``RUN/model/pockengine.json`` (and its
checkpoint's options) are then made hostile: a factory of ``os:system`` whose keyword
argument is a shell command, ``subprocess:run``, ``builtins:eval``, or a module that
records its own import. Every command that loads a run (``pe.load_run``, ``predict``,
``evaluate``, ``generate``, ``export RUN``) refuses it before anything is imported, with
and without ``--factory`` naming another factory; the run loads when the user names the
factory it trained. Every entry of ``pockengine.json`` is checked, by one reader, before
anything acts on it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pockengine as pe
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint
from pockengine.finetune.run_folder.home_load import load_run
from pockengine.finetune.run_folder.run_meta import RunFileError, read_model_meta
from pockengine.tasks.config import FinetuneError
from tests.test_finetune_resume import write_task

FACTORY = "tiny_bag:bag"
PROBE = """
import pathlib
pathlib.Path(__file__).with_name("probe_imported").write_text("imported")

def build(**kwargs):
    pathlib.Path(__file__).with_name("probe_called").write_text("called")
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished run of the tiny factory model (the module and data beside it)."""
    folder = tmp_path_factory.mktemp("factory_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        task = write_task(folder)
        pe.finetune(**{**task, "epochs": 1, "max_train": 32}, out=str(folder / "run"))
        yield folder


@pytest.fixture
def run(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the trained run, its factory module and the probe module importable."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    (tmp_path / "probe_mod.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run"


def _meta_path(run: Path) -> Path:
    return run / "model" / "pockengine.json"


def _edit_meta(run: Path, **entries: Any) -> None:
    meta = json.loads(_meta_path(run).read_text())
    for key, value in entries.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    _meta_path(run).write_text(json.dumps(meta))


HOSTILE = [
    ("os:system", {"command": "touch {marker}"}),
    ("subprocess:run", {"args": "touch {marker}", "shell": True}),
    ("builtins:eval", {"source": "open({marker!r}, 'w')"}),
    ("probe_mod:build", {}),
]


def _make_hostile(run: Path, factory: str, kwargs: dict[str, Any]) -> Path:
    marker = run.parent / "pwned"
    filled = {k: v.format(marker=str(marker)) if isinstance(v, str) else v
              for k, v in kwargs.items()}  # fmt: skip
    _edit_meta(run, factory=factory, factory_kwargs=filled)
    return marker


def _nothing_ran(run: Path, marker: Path) -> None:
    assert not marker.exists()
    assert not (run.parent / "probe_imported").exists()
    assert not (run.parent / "probe_called").exists()
    assert "probe_mod" not in sys.modules


@pytest.mark.parametrize(("factory", "kwargs"), HOSTILE)
@pytest.mark.parametrize("named", [None, FACTORY, "probe_mod:build"])
def test_hostile_factory_is_refused_before_anything_is_imported(
    run: Path, factory: str, kwargs: dict[str, Any], named: str | None
) -> None:
    marker = _make_hostile(run, factory, kwargs)
    if named == factory:  # the user named the recorded factory: that is their choice
        named = FACTORY
    before = set(sys.modules)
    with pytest.raises(FinetuneError) as caught:
        load_run(run, factory=named)
    assert set(sys.modules) == before  # nothing imported at all
    message = str(caught.value)
    assert str(_meta_path(run)) in message and factory in message
    assert ("--factory module:name" in message) if named is None else (named in message)
    _nothing_ran(run, marker)


COMMANDS = [
    ["predict", "RUN", "great film"],
    ["evaluate", "RUN"],
    ["generate", "RUN", "--prompt", "Once"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("named", [[], ["--factory", FACTORY]])
def test_every_command_refuses_a_hostile_factory(
    run: Path, command: list[str], named: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    marker = _make_hostile(run, "os:system", {"command": "touch {marker}"})
    args = [str(run) if a == "RUN" else a for a in command]
    assert main([*args, *named]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pockengine.json" in err and "os:system" in err
    _nothing_ran(run, marker)


def test_stored_options_naming_a_factory_are_refused_too(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``evaluate`` rebuilds the validation split from the options the run stored: a
    factory among them is refused unless it is the one the user named."""
    meta = json.loads(_meta_path(run).read_text())
    _edit_meta(run, config={**meta["config"], "model": "probe_mod:build"})
    assert main(["evaluate", str(run), "--factory", FACTORY]) == 2
    err = capsys.readouterr().err
    assert "probe_mod:build" in err and FACTORY in err and "pockengine.json" in err
    _nothing_ran(run, run.parent / "pwned")


@pytest.mark.parametrize("named", [[], ["--factory", FACTORY]])
def test_export_refuses_a_checkpoint_naming_other_code(
    run: Path, named: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = run / checkpoint.CHECKPOINT
    saved = checkpoint.load(path)
    saved.config["model"] = "probe_mod:build"
    checkpoint.save(path, saved)
    assert main(["export", str(run), "--target", "step", *named]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "probe_mod:build" in err
    _nothing_ran(run, run.parent / "pwned")
    assert not (run / "export_step").exists()


def test_a_factory_run_loads_with_the_factory_named(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["predict", str(run), "great film"]) == 2
    err = capsys.readouterr().err
    assert "--factory module:name" in err and FACTORY in err
    assert main(["predict", str(run), "great film", "--factory", FACTORY]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line == load_run(run, factory=FACTORY).predict(["great film"])[0]
    assert main(["predict", str(run), "great film", "--factory", "not a name"]) == 2
    assert "'not a name' is not module:name" in capsys.readouterr().err


def test_factory_for_a_run_that_needs_none(run: Path) -> None:
    preprocessing = {"resize": {"size": [8, 8]}}
    _edit_meta(run, kind="vision", classes=2, preprocessing=preprocessing)
    with pytest.raises(FinetuneError, match="is not a module:factory run"):
        load_run(run, factory=FACTORY)


# -- pockengine.json, checked entry by entry ---------------------------------------------


BROKEN: list[tuple[dict[str, Any], str]] = [
    ({"labels": None}, "no 'labels' entry"),
    ({"labels": "neg,pos"}, "'labels' is 'neg,pos'; expected a list of str"),
    ({"labels": []}, "'labels' is empty"),
    ({"seq_len": "abc"}, "'seq_len' is 'abc'; expected a positive integer"),
    ({"seq_len": None}, "no 'seq_len' entry"),
    ({"kind": "pickle"}, "'kind' is 'pickle'"),
    ({"task": 3}, "'task' is 3"),
    ({"factory": None}, "no 'factory' entry"),
    ({"factory": "os.system()"}, "expected module:name"),
    ({"factory_kwargs": {"vocab_size": {"nested": 1}}}, "'factory_kwargs'"),
    ({"factory_kwargs": [1, 2]}, "expected a JSON object of plain values"),
    ({"tokenizer": {"kind": "words", "vocab": 7}}, "'tokenizer'"),
    ({"config": "model=x"}, "'config'"),
]


@pytest.mark.parametrize(("entries", "message"), BROKEN, ids=lambda v: str(v)[:30])
def test_a_broken_model_description_names_the_file_and_entry(
    run: Path, entries: dict[str, Any], message: str
) -> None:
    _edit_meta(run, **entries)
    with pytest.raises(RunFileError) as caught:
        load_run(run, factory=FACTORY)
    assert str(_meta_path(run)) in str(caught.value) and message in str(caught.value)
    _nothing_ran(run, run.parent / "pwned")


@pytest.mark.parametrize("content", ["[1, 2]", '{"format": "pockengine-model/1", "kind"', ""])
def test_a_model_description_that_is_not_an_object(tmp_path: Path, content: str) -> None:
    path = tmp_path / "pockengine.json"
    path.write_text(content)
    with pytest.raises(RunFileError, match=str(path)):
        read_model_meta(path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"review": "great film"}', "", '{"review": "dull'], ":3: not a JSON line"),
        (['{"review": "great film"}', '{"text": "no review"}'], ":2: no 'review' field"),
        (['{"review": 7}'], ":1: 'review' is 7, not a text"),
    ],
)
def test_a_broken_input_line_names_the_file_and_line(
    run: Path, lines: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = run.parent / "inputs.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    assert main(["predict", str(run), "--factory", FACTORY, "--input", str(inputs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{inputs}{message}" in err


def test_inputs_that_are_not_text_name_the_file(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = run.parent / "inputs.csv"
    inputs.write_bytes(b"review\n\xff\xfe broken\n")
    assert main(["predict", str(run), "--factory", FACTORY, "--input", str(inputs)]) == 2
    err = capsys.readouterr().err
    assert f"{inputs}: cannot read the inputs" in err
