"""The task a compile child writes and the process that trains loads (``compile_child``).

``save_task(folder, task)`` (in the child) writes the encoded splits as
``task.safetensors`` and the rest (labels, notes, how ``RUN/model`` is written, the
model's buffer names) as ``task.json``. ``load_compiled(folder, backend)`` (in the
process that trains, once the child has exited) loads the step artifact, its evaluator
and a ``Task`` whose model is a stand-in that holds nothing and refuses to run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from pockengine.finetune.compiling.child_folder import MODEL_DIR, STEP_DIR, TASK_DATA, TASK_JSON
from pockengine.safetensors_io import write_safetensors_to
from pockengine.step.artifact import LoadedStep, load_step, read_tensors
from pockengine.step.evaluator import Evaluator
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneError

__all__ = ["Compiled", "load_compiled", "save_task", "save_task_data", "save_task_info"]

_SPLITS = ("train", "val", "test")


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
        raise FinetuneError(
            "the model was compiled in a child process and is not here; "
            "run with --compile-in process to use it eagerly"
        )


def _no_loss(*args: Any) -> Any:
    raise FinetuneError("the loss was compiled in a child process (--compile-in child)")


def load_compiled(folder: Path, backend: str) -> Compiled:
    """The step (only the backend compiles), its evaluator and the task in ``folder``."""
    step = load_step(folder / STEP_DIR, backend)
    return Compiled(step, step.evaluator(), *_load_task(folder), folder / MODEL_DIR)


def _load_task(folder: Path) -> tuple[recipes.Task, tuple[str, ...]]:
    try:
        info = json.loads((folder / TASK_JSON).read_text())
        arrays = read_tensors(folder / TASK_DATA)
        splits = {
            s: tuple(_expanded(arrays, f"{s}.{i}") for i in range(info["arrays"][s]))
            for s in _SPLITS
        }
        task = recipes.Task(
            info["name"],
            _CompiledElsewhere(),
            _no_loss,
            splits["train"],
            splits["val"],
            tuple(info["labels"]),
            info["kind"],
            list(info["notes"]),
            info["inputs"],
            splits["test"],
            None,
            dict(info["home"]),
        )
        return task, tuple(info["buffers"])
    except FinetuneError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FinetuneError(
            f"{folder}: the task the compile child wrote ({TASK_JSON}, {TASK_DATA}) is "
            f"damaged or incomplete ({type(e).__name__}: {e}); compile again"
        ) from e


def _expanded(arrays: dict[str, np.ndarray[Any, Any]], name: str) -> np.ndarray[Any, Any]:
    """``arrays[name]``, broadcast back to its full shape where it was written compact (a
    read-only view: the data order copies each batch out of it)."""
    if name not in arrays:
        raise FinetuneError(f"{TASK_DATA} has no array {name!r}")
    value, shape = arrays.pop(name), arrays.pop(name + _SHAPE, None)
    if shape is None:
        return value
    try:
        return np.broadcast_to(value, tuple(int(n) for n in shape.reshape(-1)))
    except ValueError as e:
        raise FinetuneError(
            f"{TASK_DATA}: {name}{_SHAPE} = {shape.tolist()} does not fit {name}'s "
            f"shape {list(value.shape)}"
        ) from e


def save_task(folder: Path, task: recipes.Task) -> None:
    """Write ``task``'s encoded splits and what else the process that trains reads."""
    save_task_data(folder, task)
    save_task_info(folder, task)


def save_task_data(folder: Path, task: recipes.Task) -> None:
    """Write ``task``'s encoded splits (``save_task``'s data half). An array broadcast
    along an axis (stride 0: lite0-fashion's three identical channels) is written as its
    one copy plus its shape (``NAME.shape``), and read back as the same broadcast view, so
    the process that trains holds it once."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for s in _SPLITS:
        for i, a in enumerate(getattr(task, s)):
            name = f"{s}.{i}"
            compact = _compact(a)
            arrays[name] = compact
            if compact.shape != a.shape:
                arrays[name + _SHAPE] = np.asarray(a.shape, dtype=np.int64)
    with (folder / TASK_DATA).open("wb") as f:
        write_safetensors_to(f, arrays)


_SHAPE = ".shape"  # the full shape of a split's array written compact


def _compact(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``a`` with every broadcast axis (stride 0, length > 1) cut to length 1."""
    broadcast = [st == 0 and n > 1 for st, n in zip(a.strides, a.shape, strict=True)]
    if not any(broadcast):
        return a
    return a[tuple(slice(0, 1) if b else slice(None) for b in broadcast)]


def save_task_info(folder: Path, task: recipes.Task) -> None:
    """Write what else of ``task`` the process that trains reads (``save_task``'s other
    half): names, labels, notes, how ``RUN/model`` is written, the buffer names, and how
    many arrays each split has."""
    info = {
        "name": task.name, "labels": list(task.labels), "kind": task.kind,
        "notes": list(task.notes), "inputs": task.inputs, "home": task.home,
        "buffers": [n for n, _ in task.model.named_buffers()],
        "arrays": {s: len(getattr(task, s)) for s in _SPLITS},
    }  # fmt: skip
    (folder / TASK_JSON).write_text(json.dumps(info))
