"""``--scheme auto`` with ``--compile-in child``: the analysis in a child process too.

The analysis (``auto_scheme.choose_auto``) needs the model and torch, which the process
that trains must not hold while the compile child runs (``compile_child``).
``choose_in_child(config, folder)`` runs ``python -m pockengine.finetune.auto_child
FOLDER``: the child builds the task, chooses the scheme (or reads the choice from the
cache) and writes ``choice.json`` (``AutoChoice.to_dict``), then exits; the caller gives
the chosen scheme to the compile child and the choice to the summary. So a run with
``--scheme auto`` never holds two copies of torch and the model, at the price of building
the task once more (model, tokenizer, the data encoded). This module imports no torch. A
child that fails writes ``error.json`` (the error's class and message), raised here again
as it was.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.ir import errors

__all__ = ["choose_in_child", "main"]

JOB, CHOICE, ERROR = "auto-job.json", "choice.json", "auto-error.json"
_ERRORS: dict[str, type[errors.PockEngineError]] = {  # raised here as the child raised them
    cls.__name__: cls
    for cls in (FinetuneError, errors.CompileError, errors.SchemeError, errors.ShapeError,
                errors.UnsupportedOpError, errors.PockEngineError)
}  # fmt: skip


def choose_in_child(config: FinetuneConfig, folder: Path) -> dict[str, Any]:
    """The ``AutoChoice`` (as a dict) that a child process makes for ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    torch = sys.modules.get("torch")  # a caller's torch.set_num_threads holds for the child
    threads = torch.get_num_threads() if torch is not None else None
    (folder / JOB).write_text(json.dumps({"config": config.to_dict(), "threads": threads}))
    command = [sys.executable, "-m", "pockengine.finetune.auto_child", str(folder)]
    # the child imports what this process can (a factory model's module on sys.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = subprocess.run(command, check=False, env=env).returncode
    if code != 0:
        _raise_child_error(folder, code)
    choice: dict[str, Any] = json.loads((folder / CHOICE).read_text())
    return choice


def _raise_child_error(folder: Path, code: int) -> None:
    try:
        error = json.loads((folder / ERROR).read_text())
    except (OSError, ValueError):
        raise FinetuneError(
            f"choosing the auto scheme in a child process failed (exit code {code}); its "
            "output is above (--compile-in process analyses and compiles here)"
        ) from None
    raise _ERRORS.get(str(error.get("type")), FinetuneError)(str(error.get("message")))


def choose_into(folder: Path) -> None:
    """The child's work: build the task of ``JOB`` in ``folder``, choose, write ``CHOICE``."""
    import torch

    from pockengine.finetune import recipes
    from pockengine.finetune.auto_scheme import choose_auto

    job = json.loads((folder / JOB).read_text())
    if job["threads"] is not None:
        torch.set_num_threads(int(job["threads"]))
    config = FinetuneConfig(**job["config"])
    task = recipes.build(config)
    choice = choose_auto(config, task, recipes.RECIPES[recipes.recipe_name(config)].sparse)
    (folder / CHOICE).write_text(json.dumps(choice.to_dict()))


def main(argv: list[str]) -> int:
    """``python -m pockengine.finetune.auto_child FOLDER`` (``choose_in_child``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    folder = Path(argv[0])
    try:
        choose_into(folder)
    except errors.PockEngineError as exc:
        (folder / ERROR).write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
