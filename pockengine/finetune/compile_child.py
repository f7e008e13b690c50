"""``pockengine finetune --compile-in child``: compile in a child process, train here.

What the device sees is the whole-process peak of the process that trains. Compiling
there costs the model's framework code (transformers, torch.export, sympy), the tokenizer,
the float model and the compiler's leftovers, none of which the training loop reads.
``compile_in_child(config, scheme, folder)`` runs ``python -m
pockengine.finetune.compile_child FOLDER``, which builds the task (model, tokenizer, the
data encoded), compiles the step and its evaluator as the run would
(``trainer.compile_task``, ``trainer.compile_evaluator_releasing``) and writes into ``FOLDER``:

- ``step/``: the step artifact with its evaluator (``pockengine.step_io``);
- ``task.safetensors`` and ``task.json``: the encoded splits, the labels, the notes, how
  ``RUN/model`` is written, and the model's buffer names;
- ``model/``: the skeleton of ``RUN/model`` (``model_skeleton``).

Then it exits, and this process loads the step (only the backend compiles) and a ``Task``
whose model is a stand-in that holds nothing and refuses to run. A child that fails
writes ``error.json`` (the error's class and message), raised here again as it was.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.evaluator import Evaluator
from pockengine.finetune import recipes
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.finetune.model_skeleton import write_skeleton
from pockengine.ir import errors
from pockengine.safetensors_io import write_safetensors_to
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.step_io import LoadedStep, load_step, read_tensors

__all__ = ["Compiled", "compile_in_child", "main"]

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]
JOB, ERROR, TASK_JSON, TASK_DATA = "job.json", "error.json", "task.json", "task.safetensors"
STEP_DIR, MODEL_DIR = "step", "model"
_SPLITS = ("train", "val", "test")
_ERRORS: dict[str, type[errors.PockEngineError]] = {  # raised here as the child raised them
    cls.__name__: cls
    for cls in (FinetuneError, errors.CompileError, errors.SchemeError, errors.ShapeError,
                errors.UnsupportedOpError, errors.PockEngineError)
}  # fmt: skip


@dataclass
class Compiled:
    """What the child wrote, loaded: the step, its evaluator, the task (no model), the
    model's buffer names and the skeleton of ``RUN/model``."""

    step: LoadedStep
    evaluator: Evaluator
    task: recipes.Task
    buffers: tuple[str, ...]
    skeleton: Path


class _CompiledElsewhere(nn.Module):
    """The task's model in the process that trains a step compiled in a child: it holds
    no weights, and running it is an error (evaluation runs on the compiled step)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise FinetuneError("the model was compiled in a child process and is not here; "
                            "run with --compile-in process to use it eagerly")  # fmt: skip


def _no_loss(*args: Any) -> Any:
    raise FinetuneError("the loss was compiled in a child process (--compile-in child)")


def compile_in_child(config: FinetuneConfig, scheme: Scheme, folder: Path) -> Compiled:
    """Compile ``config``'s task in a child process writing into ``folder``; load it."""
    folder.mkdir(parents=True, exist_ok=True)
    job = {"config": config.to_dict(), "scheme": scheme.to_dict(),
           "threads": torch.get_num_threads()}  # fmt: skip
    (folder / JOB).write_text(json.dumps(job))
    command = [sys.executable, "-m", "pockengine.finetune.compile_child", str(folder)]
    # the child imports what this process can (a factory model's module on sys.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = subprocess.run(command, check=False, env=env).returncode
    if code != 0:
        _raise_child_error(folder, code)
    step = load_step(folder / STEP_DIR, config.backend)
    return Compiled(step, step.evaluator(), *_load_task(folder), folder / MODEL_DIR)


def _raise_child_error(folder: Path, code: int) -> None:
    try:
        error = json.loads((folder / ERROR).read_text())
    except (OSError, ValueError):
        raise FinetuneError(
            f"compiling in a child process failed (exit code {code}); its "
            "output is above (--compile-in process compiles here)"
        ) from None
    kind = _ERRORS.get(str(error.get("type")), FinetuneError)
    raise kind(str(error.get("message")))


def _load_task(folder: Path) -> tuple[recipes.Task, tuple[str, ...]]:
    info = json.loads((folder / TASK_JSON).read_text())
    arrays = read_tensors(folder / TASK_DATA)
    splits = {s: tuple(arrays.pop(f"{s}.{i}") for i in range(info["arrays"][s])) for s in _SPLITS}
    task = recipes.Task(info["name"], _CompiledElsewhere(), _no_loss, splits["train"],
                        splits["val"], tuple(info["labels"]), info["kind"], list(info["notes"]),
                        info["inputs"], splits["test"], None, dict(info["home"]))  # fmt: skip
    return task, tuple(info["buffers"])


def _save_task(folder: Path, task: recipes.Task) -> None:
    arrays = {f"{s}.{i}": a for s in _SPLITS for i, a in enumerate(getattr(task, s))}
    with (folder / TASK_DATA).open("wb") as f:
        write_safetensors_to(f, arrays)
    info = {
        "name": task.name, "labels": list(task.labels), "kind": task.kind,
        "notes": list(task.notes), "inputs": task.inputs, "home": task.home,
        "buffers": [n for n, _ in task.model.named_buffers()],
        "arrays": {s: len(getattr(task, s)) for s in _SPLITS},
    }  # fmt: skip
    (folder / TASK_JSON).write_text(json.dumps(info))


def _compile_here(folder: Path) -> None:
    """The child's work: build the task, compile the step and its evaluator, write them."""
    from pockengine.finetune import released
    from pockengine.finetune.trainer import compile_evaluator_releasing, compile_task

    job = json.loads((folder / JOB).read_text())
    torch.set_num_threads(int(job["threads"]))
    config = FinetuneConfig(**job["config"])
    task = recipes.build(config)
    step = compile_task(config, task, schemes.from_dict(job["scheme"]))
    evaluator = compile_evaluator_releasing(step, task)  # the model's copies released
    if evaluator is None:
        raise FinetuneError("this task's evaluation does not compile, and only a compiled "
                            "one runs without the model: use --compile-in process")  # fmt: skip
    step.save(folder / STEP_DIR, evaluator)
    _save_task(folder, task)
    write_skeleton(folder / MODEL_DIR, task, released.step_values(step))


def main(argv: list[str]) -> int:
    """``python -m pockengine.finetune.compile_child FOLDER`` (``compile_in_child``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    folder = Path(argv[0])
    try:
        _compile_here(folder)
    except errors.PockEngineError as exc:
        (folder / ERROR).write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
