"""The documented commands work as documented.

The README's main command is run in a fresh virtualenv by ``.ci/main_job.sh`` (CI runs it
after the tests). Here: the README opens with the two commands CI reads, and every recipe's
install line in ``pockengine finetune --help`` installs, into a fresh virtualenv, what that
recipe needs to run two steps (slow: a virtualenv per recipe).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pockengine.finetune.cli import EPILOG
from pockengine.tasks.recipes import RECIPES

BUILTIN = sorted(set(RECIPES) - {"generic", "generic-lm"})  # the user's own --model and --data
ROOT = Path(__file__).resolve().parent.parent
_COMMAND = re.compile(r"(?:pip install|apt-get install|apt-get update)\b")


def _readme(which: str) -> str:
    script = ROOT / ".ci" / "readme_commands.py"
    return subprocess.run(
        [sys.executable, str(script), which], check=True, capture_output=True, text=True
    ).stdout.strip()


def recipe_install_lines(epilog: str = EPILOG) -> dict[str, list[str]]:
    """Recipe name -> the shell commands its entry in ``finetune --help`` tells to run."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in epilog.splitlines():
        head = re.match(r"  (\S+)\s{2,}", line)
        if head:
            current = blocks.setdefault(head.group(1), [])
        elif not line.startswith("    "):
            current = None
        if current is not None:
            current.append(line.strip())
    out = {}
    for name, lines in blocks.items():
        text = " ".join(lines)
        first = _COMMAND.search(text)
        if first is None:
            continue
        text = text[first.start() :]
        # Commands on separate help lines without && between them are separate commands.
        text = re.sub(rf"(?<!&&) (?={_COMMAND.pattern})", " && ", text)
        out[name] = [c.strip() for c in text.split("&&") if c.strip()]
    return out


def test_readme_opens_with_the_main_job_and_the_test_command() -> None:
    install = _readme("main-install")
    assert install.startswith("pip install torch==2.13.0 && pip install -e .")
    assert _readme("main-job").startswith("pockengine finetune")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_commands.py tests" in ci and "main_job.sh" in ci
    assert "python -m pytest" in _readme("tests")


def test_every_builtin_recipe_documents_its_install_line() -> None:
    lines = recipe_install_lines()
    missing = set(BUILTIN) - set(lines)
    assert not missing, f"recipes without an install line: {missing}"
    for name, commands in lines.items():
        assert commands, name
        for command in commands:
            assert _COMMAND.match(command), (name, command)
            assert "torch" not in command.split(), f"{name}: an unpinned torch: {command}"


def test_the_install_line_parser_splits_commands() -> None:
    epilog = (
        "recipes:\n"
        "  a-recipe   some model\n"
        "             on data: pip install --no-deps x &&\n"
        "             pip install y\n"
        "             apt-get update && apt-get install -y z\n"
        "  other      no install\n"
        "after\n"
    )
    assert recipe_install_lines(epilog) == {
        "a-recipe": [
            "pip install --no-deps x",
            "pip install y",
            "apt-get update",
            "apt-get install -y z",
        ]
    }


@pytest.mark.slow
@pytest.mark.parametrize("recipe", BUILTIN)
def test_recipe_install_line_runs_two_steps_in_a_fresh_venv(recipe: str, tmp_path: Path) -> None:
    commands = recipe_install_lines()[recipe]
    if any(c.startswith("apt-get") for c in commands) and (
        shutil.which("apt-get") is None or os.geteuid() != 0
    ):
        pytest.skip(f"{recipe} installs Debian packages: needs apt-get as root")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    setup = ["pip install -q torch==2.13.0", f"pip install -q {ROOT}", *commands]
    for command in setup:
        done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    run = [
        "pockengine", "finetune", "--recipe", recipe, "--max-steps", "2", "--max-val", "8",
        "--max-train", "64", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint.safetensors").is_file()


def test_ci_reads_the_after_the_run_commands() -> None:
    """``.ci/main_job.sh`` runs these on the main job's folder: evaluate, predict and
    ``pe.load_run``, never ``generate`` (the main job is not a causal LM)."""
    after = _readme("after-run").splitlines()
    assert [c for c in after if c.startswith("pockengine evaluate ")]
    assert [c for c in after if c.startswith("pockengine predict ")]
    assert [c for c in after if "pe.load_run(" in c]
    assert not [c for c in after if "generate" in c]
    assert "readme_commands.py after-run" in (ROOT / ".ci" / "main_job.sh").read_text()
