"""benchmarks/docs_tables.py: the benchmark tables in the README and the docs are the ones
the committed results generate, each with the command that produced it."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_tables", ROOT / "benchmarks" / "docs_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_tables"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_tables_are_what_the_results_generate(tables: ModuleType) -> None:
    stale = [str(p.relative_to(ROOT)) for p in tables.stale()]
    assert not stale, f"run python benchmarks/docs_tables.py: {stale}"


def test_a_figure_edited_by_hand_is_caught(tables: ModuleType, tmp_path: Path) -> None:
    for table in tables.TABLES:
        copy = tmp_path / table.path
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / table.path, copy)
    doc = tmp_path / "README.md"
    text = doc.read_text(encoding="utf-8")
    start, end = tables.TABLES[0].markers
    head, rest = text.split(start, 1)
    body, tail = rest.split(end, 1)
    edited = body.replace("0.", "0.9", 1)
    assert edited != body
    doc.write_text(head + start + edited + end + tail, encoding="utf-8")
    assert tables.stale(tmp_path) == [doc]


def test_every_table_names_the_command_behind_it(tables: ModuleType) -> None:
    for table in tables.TABLES:
        body = table.render()
        if table.path == "README.md":  # the headline rows link to the pages with commands
            assert "](docs/" in body
        else:
            assert "python benchmarks/" in body, table.markers


def test_commands_are_rebuilt_from_stored_options(tables: ModuleType) -> None:
    args = {"recipe": "r", "cases": ["a", "b"], "steps": 3, "seq_len": None, "in_place": True,
            "keep": False, "child": "x"}  # fmt: skip
    command = tables.rebuilt_command("python benchmarks/x.py", args)
    assert command == "python benchmarks/x.py --recipe r --cases a b --steps 3 --in-place"
