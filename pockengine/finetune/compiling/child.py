"""The protocol of the fine-tune's helper processes (``compile_child``).

The parent writes a job (JSON) into a folder and runs ``python -m MODULE FOLDER``; the
child reads the job, does its work, writes its results into the folder and exits. A
child that fails with one of the engine's errors writes its class and message to an
error file and exits with 2; the parent raises that error again, as it was. Any other
exit is a ``FinetuneError`` naming the work and pointing at the child's output (which
went to the same terminal). This module imports no torch: the parent may be torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pockengine.ir import errors
from pockengine.tasks.config import FinetuneError

__all__ = ["child_main", "read_job", "run_child"]

_ERRORS: dict[str, type[errors.PockEngineError]] = {  # raised here as the child raised them
    cls.__name__: cls
    for cls in (
        FinetuneError,
        errors.CompileError,
        errors.SchemeError,
        errors.ShapeError,
        errors.UnsupportedOpError,
        errors.PockEngineError,
    )
}


def run_child(
    module: str, folder: Path, job_file: str, job: dict[str, Any], error_file: str, what: str
) -> None:
    """Write ``job`` (plus the caller's torch thread count) and run ``module`` on
    ``folder``; raise the child's error here. ``what`` names the work in messages."""
    folder.mkdir(parents=True, exist_ok=True)
    torch = sys.modules.get("torch")  # a caller's torch.set_num_threads holds for the child
    threads = torch.get_num_threads() if torch is not None else None
    (folder / job_file).write_text(json.dumps({**job, "threads": threads}))
    command = [sys.executable, "-m", module, str(folder)]
    # the child imports what this process can (a factory model's module on sys.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = subprocess.run(command, check=False, env=env).returncode
    if code == 0:
        return
    try:
        error = json.loads((folder / error_file).read_text())
    except (OSError, ValueError):
        raise FinetuneError(
            f"{what} in a child process failed (exit code {code}); its output is above "
            "(--compile-in process does it in this process)"
        ) from None
    raise _ERRORS.get(str(error.get("type")), FinetuneError)(str(error.get("message")))


def read_job(folder: Path, job_file: str) -> dict[str, Any]:
    """The job ``run_child`` wrote, its torch thread count applied (the child imports
    torch anyway)."""
    job: dict[str, Any] = json.loads((folder / job_file).read_text())
    if job.get("threads") is not None:
        import torch

        torch.set_num_threads(int(job["threads"]))
    return job


def child_main(argv: list[str], work: Callable[[Path], None], error_file: str) -> int:
    """A child's ``main``: ``work(FOLDER)``; an engine error goes to ``error_file``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    folder = Path(argv[0])
    try:
        work(folder)
    except errors.PockEngineError as exc:
        (folder / error_file).write_text(
            json.dumps({"type": type(exc).__name__, "message": str(exc)})
        )
        return 2
    return 0
