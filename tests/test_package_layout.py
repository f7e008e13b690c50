"""The package's layering as a user and a reader meet it: ``import pockengine`` loads the
engine without the fine-tuning application, every public name of ``pockengine`` still
resolves, and nothing below the command line imports the package's front door.
The full layering is checked by ``lint-imports`` (``[tool.importlinter]`` in pyproject.toml).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = ("pockengine.finetune", "pockengine.tasks", "pockengine.scheme_choice",
               "pockengine.federated", "pockengine.zoo")  # fmt: skip
# the modules allowed to import ``pockengine`` itself: the command line, above everything
FRONT_DOOR_USERS = {"pockengine.__main__", "pockengine.cli", "pockengine.export_cli"}


def _run(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True)  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    sys.path.insert(0, str(ROOT))
    try:
        return grimp.build_graph("pockengine")
    finally:
        sys.path.remove(str(ROOT))


def test_import_pockengine_loads_no_application_module() -> None:
    result = _run(
        "import json, sys, pockengine\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({APPLICATION!r}))))"
    )
    assert result == []


def test_every_public_name_resolves_and_finetune_calls() -> None:
    result = _run(
        "import json, pockengine as pe\n"
        "from pockengine.tasks.config import FinetuneError\n"
        "names = {n: getattr(pe, n) is not None for n in pe.__all__}\n"
        "try:\n"
        "    pe.finetune(no_such_option=1)\n"
        "    raised = None\n"
        "except pe.FinetuneError as exc:\n"
        "    raised = str(exc)\n"
        "print(json.dumps({'names': names, 'raised': raised,\n"
        "                  'same': pe.FinetuneError is FinetuneError}))"
    )
    assert result["names"] == {n: True for n in result["names"]}  # type: ignore[union-attr]
    assert set(result["names"]) >= {"compile", "finetune", "load_run", "FinetuneError"}  # type: ignore[arg-type]
    assert "unknown finetune options ['no_such_option']" in str(result["raised"])
    assert result["same"] is True


def test_finetune_calls_after_a_submodule_bound_the_package() -> None:
    """Importing ``pockengine.finetune.cli`` first binds the package, not the function, to
    ``pockengine.finetune``: the package calls as ``finetune`` all the same."""
    result = _run(
        "import json, pockengine.finetune.cli, pockengine as pe\n"
        "try:\n"
        "    pe.finetune(no_such_option=1)\n"
        "    raised = None\n"
        "except pe.FinetuneError as exc:\n"
        "    raised = str(exc)\n"
        "print(json.dumps({'raised': raised, 'config': pe.finetune.FinetuneConfig.__name__}))"
    )
    assert "unknown finetune options" in str(result["raised"])
    assert result["config"] == "FinetuneConfig"


def test_only_the_command_line_imports_the_front_door(graph: grimp.ImportGraph) -> None:
    assert graph.find_modules_that_directly_import("pockengine") <= FRONT_DOOR_USERS


def test_help_text_and_zoo_sit_below_fine_tuning(graph: grimp.ImportGraph) -> None:
    for module in ("pockengine.cli_help", "pockengine.zoo"):
        upstream = graph.find_upstream_modules(module)
        assert not {m for m in upstream if m.startswith("pockengine.finetune")}, module
        assert "pockengine" not in upstream, module


def test_scheme_choice_and_tasks_import_no_fine_tuning_run(graph: grimp.ImportGraph) -> None:
    for package in ("pockengine.scheme_choice", "pockengine.tasks"):
        upstream = graph.find_upstream_modules(package, as_package=True)
        assert not {m for m in upstream if m.startswith("pockengine.finetune")}, package
