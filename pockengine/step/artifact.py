"""The step artifact: a compiled training step as files, run without the compiler.

``step.save(folder)`` writes what the compiler made, and ``load_step(folder)`` runs it in
a process that never imports a frontend, torch.export or transformers, and runs no IR
pass: only the backend's own compile (torch code generation, NumPy's plan, C) happens at
load. Compile on a host, ship the folder, train on the device. The folder holds:

- ``step.ir``: the final training graph as IR text (``ir.print_graph``; ``ir.parser`` reads
  it back and ``ir.verify`` checks it);
- ``state.safetensors``: the store by IR name: trained params, frozen weights (quantized
  ones as their codes, scales and offsets, as stored), buffers, optimizer state, the
  learning rate; written one tensor at a time, without the tensors whose bytes are all
  zero (the optimizer state of a step never run), which ``step.json`` lists under
  ``zeros`` and ``load_step`` allocates;
- ``step.json``: the rest (``pockengine.step.artifact_json``): batch inputs, IR -> model names and
  aliases, the quantized params, partial-channel rows, index bounds of the batch checks,
  the optimizer, the model's param table, the scheme and the compile-time report;
- ``eval.ir`` and ``eval.safetensors`` when a compiled evaluator was saved with it.

Nothing is pickled: JSON, safetensors and IR text only. A missing, damaged or mismatched
file is a ``StepFileError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pockengine.backends import Backend, BackendSpec, get_backend
from pockengine.ir import Graph, PockEngineError, Role, Value, print_graph, verify
from pockengine.ir.arrays import Array
from pockengine.ir.parser import parse_graph
from pockengine.safe_write import make_dirs, write_text, write_with
from pockengine.safetensors_io import (
    SAFETENSORS_DTYPES,
    LazyTensors,
    SafetensorsError,
    all_zero,
    write_streamed_to,
)
from pockengine.step.artifact_json import READABLE_FORMATS, Saved, from_json, to_json
from pockengine.step.evaluator import Evaluator
from pockengine.step.running import CompiledStep

if TYPE_CHECKING:
    from pockengine.plan.report import Report

__all__ = [
    "LoadedStep",
    "StepFileError",
    "check_state",
    "load_step",
    "parse_graph_text",
    "read_graph",
    "read_graph_text",
    "read_tensors",
    "save_step",
    "write_graph",
    "write_values",
]

GRAPH, STATE, META = "step.ir", "state.safetensors", "step.json"
EVAL_GRAPH, EVAL_STATE = "eval.ir", "eval.safetensors"
_SAFETENSORS_NAMES = {np.dtype(v) for v in SAFETENSORS_DTYPES.values()}


class StepFileError(PockEngineError):
    """A step artifact file that is missing, damaged, or does not match the others."""


def save_step(
    step: CompiledStep,
    folder: str | os.PathLike[str],
    evaluator: Evaluator | None = None,
    report: Report | None = None,
) -> Path:
    """Write ``step`` (and ``evaluator``, compiled for it) as a step artifact in ``folder``
    (created; files of an earlier artifact there are replaced). ``report``: the step's
    ``report()`` when the caller has it already (it is computed otherwise). Returns the
    folder."""
    if evaluator is not None and evaluator.step is not step:
        raise StepFileError("the evaluator was compiled for another step")
    out = make_dirs(Path(folder))
    text = print_graph(step.graph)
    _check_round_trip(step.graph, text, GRAPH)
    _write_text(out / GRAPH, text)
    zeros = _write_tensors(out / STATE, step._store, step.backend)
    eval_meta = None
    if evaluator is not None:
        eval_text = print_graph(evaluator.graph)
        _check_round_trip(evaluator.graph, eval_text, EVAL_GRAPH)
        _write_text(out / EVAL_GRAPH, eval_text)
        eval_zeros = _write_tensors(out / EVAL_STATE, evaluator._own, step.backend)
        eval_meta = {"batch": [v.name for v in evaluator._batch], "sha256": _digest(eval_text),
                     "zeros": eval_zeros}  # fmt: skip
    meta = to_json(step, report or step.report(), _digest(text), eval_meta)
    meta["zeros"] = zeros
    _write_text(out / META, json.dumps(meta, indent=1) + "\n")
    return out


def write_graph(path: Path, graph: Graph) -> str:
    """``graph`` as IR text in ``path``, checked to parse back to it; returns the text's
    SHA-256 (``read_graph`` checks it). For ``pockengine.step.child`` too."""
    text = print_graph(graph)
    _check_round_trip(graph, text, path.name)
    _write_text(path, text)
    return _digest(text)


def write_values(path: Path, values: Mapping[str, Array]) -> list[str]:
    """NumPy ``values`` as a safetensors file, the all-zero ones left out and returned (as
    ``step.json``'s ``zeros``); ``read_tensors`` reads the others back."""
    return _write_tensors(path, values, get_backend("numpy"))


def _check_round_trip(graph: Graph, text: str, name: str) -> None:
    """The printed graph must parse back to a graph that prints the same (every attr a
    literal; compared as text, where a NaN attr equals itself)."""
    back = print_graph(parse_graph(text)).splitlines()
    lines = text.splitlines()
    if back != lines:
        bad = next((a for a, b in zip(lines, back, strict=False) if a != b), "its length")
        raise StepFileError(
            f"{name}: {graph.name} does not print as text that parses back "
            f"to it (first differing line: {bad})"
        )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _write_text(path: Path, text: str) -> None:
    write_text(path, text, inside=path.parent)


def _write_tensors(path: Path, store: Mapping[str, Any], backend: Backend) -> list[str]:
    """``store`` (backend values) as a safetensors file, one tensor at a time, except the
    ones whose bytes are all zero (an optimizer state never stepped; -0.0 is not zero):
    their names are returned for
    ``step.json``, and ``load_step`` allocates them. Nothing is copied whole, and a zero
    block nothing has written is never touched (reading it maps no memory)."""
    specs, zeros = {}, []
    for name, value in store.items():
        array = backend.to_numpy(value)
        if array.dtype not in _SAFETENSORS_NAMES:
            raise StepFileError(f"{path.name}: {name}: {array.dtype} has no safetensors dtype")
        if array.size and all_zero(array):
            zeros.append(name)
        else:
            specs[name] = np.broadcast_to(np.zeros((), array.dtype), array.shape)
    write_with(path, lambda f: write_streamed_to(f, specs, lambda n: backend.to_numpy(store[n])))
    return zeros


# -- reading ------------------------------------------------------------------------------
def read_tensors(path: Path) -> dict[str, Array]:
    """Every tensor of the safetensors file ``path``, each read into its own array (no
    memory map, no second copy); a ``StepFileError`` if the file is missing or damaged."""
    try:
        lazy = LazyTensors(path)
        if path.stat().st_size != lazy.file_size:
            raise StepFileError(f"{path}: truncated or padded (size does not match header)")
        with path.open("rb") as f:
            return {name: lazy.read_from(f, name) for name in lazy.in_file_order()}
    except FileNotFoundError:
        raise StepFileError(f"{path}: missing (not a step artifact folder?)") from None
    except SafetensorsError as exc:
        raise StepFileError(str(exc)) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StepFileError(f"{path}: not a whole safetensors file ({exc})") from None


def _with_zeros(graph: Graph, values: dict[str, Array], zeros: Any, path: Path) -> dict[str, Array]:
    """``values`` and the all-zero state ``step.json`` lists (``zeros``), allocated as
    ``graph`` reads them (a name the file holds keeps the file's value)."""
    if not (isinstance(zeros, list) and all(isinstance(n, str) for n in zeros)):
        raise StepFileError(f'{path}: "zeros" should be a list of value names, got {zeros!r}')
    types = {v.name: v.type for v in graph.inputs if v.role is not Role.INPUT}
    for name in zeros:
        kind = types.get(name)
        if kind is None:
            raise StepFileError(f"{path}: lists {name!r} as zeros, which the graph does not read")
        if name not in values:
            values[name] = np.zeros(kind.shape, kind.dtype.to_numpy())
    return values


def read_graph(path: Path, digest: str) -> Graph:
    """The graph ``write_graph`` wrote (``digest``: its SHA-256), parsed and verified."""
    return parse_graph_text(read_graph_text(path, digest), path)


def read_graph_text(path: Path, digest: str) -> str:
    """The IR text ``write_graph`` wrote, checked against ``digest`` (its SHA-256)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StepFileError(f"{path}: missing (not a step artifact folder?)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StepFileError(f"{path}: cannot be read ({exc})") from None
    if _digest(text) != digest:
        raise StepFileError(
            f"{path}: not the graph {META} was written with (its SHA-256 "
            "differs): files of two artifacts, or an edited one"
        )
    return text


def parse_graph_text(text: str, path: Path) -> Graph:
    """``text`` (read from ``path``) parsed and verified."""
    try:
        return verify(parse_graph(text))
    except PockEngineError as exc:
        raise StepFileError(f"{path}: {exc}") from None


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StepFileError(f"{path}: missing (not a step artifact folder?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StepFileError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise StepFileError(
            f"{path}: step artifact format {got!r}, this PockEngine reads "
            f"{' and '.join(map(str, READABLE_FORMATS))}"
        )
    return meta


def check_state(graph: Graph, values: Mapping[str, Array], path: Path) -> None:
    """Each state input of ``graph`` is in ``values`` with the graph's shape and dtype."""
    for v in graph.inputs:
        if v.role is Role.INPUT:
            continue
        array = values.get(v.name)
        if array is None:
            raise StepFileError(f"{path}: has no {v.name}, which the graph reads")
        if array.shape != v.shape or array.dtype != v.dtype.to_numpy():
            raise StepFileError(
                f"{path}: {v.name} is {array.dtype}{list(array.shape)}, the graph reads {v.type}"
            )


class LoadedStep(CompiledStep):
    """A training step read from a step artifact (``load_step``): the runtime API of
    ``TrainStep`` (``step(*batch)``, ``lr``, ``trained``, ``written``, ``state_dict``,
    ``load_state``, ``report``, ``export``, ``save``...) without the compiler. What needs
    the compiler (``gradients``, compiling another evaluator) is not there."""

    def __init__(
        self,
        folder: Path,
        saved: Saved,
        graph: Graph,
        values: dict[str, Array],
        backend: BackendSpec,
    ) -> None:
        self.folder = folder
        self.optimizer, self.info = saved.optimizer, saved.info
        self.resolution, self.scheme = saved.resolution, saved.scheme
        self._report = saved.report
        self._bind(graph, get_backend(backend), saved.facts, values)
        self.on_nonfinite = saved.on_nonfinite
        self._evaluator: Evaluator | None = None

    def report(self, depth: int | None = None) -> Report:
        """The compile-time report as the compiler wrote it (layers cut to ``depth``), with
        the kernels this step's backend chose by measurement where it tunes (``CBackend(
        tune=True)``)."""
        from pockengine.backends.mixed import MixedBackend

        placement = None
        if isinstance(self.backend, MixedBackend):
            placement = self.backend.placement(self.graph)
        kernels = tuple(getattr(self._exec, "kernel_choices", ()))  # CBackend(tune=True)
        memory = getattr(self._exec, "memory", None)  # a backend's own plan (C)
        return self._report.at_depth(depth, placement, kernels, memory)

    def evaluator(self) -> Evaluator:
        """The compiled evaluator saved with the step; a ``StepFileError`` if none was."""
        if self._evaluator is None:
            raise StepFileError(
                f"{self.folder}: the artifact holds no evaluator ({EVAL_GRAPH} was not saved)"
            )
        return self._evaluator

    @property
    def has_evaluator(self) -> bool:
        return self._evaluator is not None

    def save(self, folder: str | os.PathLike[str], evaluator: Evaluator | None = None) -> Path:
        """Write this step as a step artifact into ``folder`` (``save_step``), with
        ``evaluator`` (compiled for this step) beside it; returns the folder."""
        return save_step(self, folder, evaluator)


def load_step(folder: str | os.PathLike[str], backend: BackendSpec | None = None) -> LoadedStep:
    """The step artifact in ``folder`` (``TrainStep.save``), bound to ``backend`` (default:
    the one it was compiled for). Only the backend compiles here; no frontend is imported
    and no IR pass runs."""
    where = Path(folder)
    meta = _read_meta(where / META)
    try:
        saved = from_json(meta)
    except (KeyError, TypeError, ValueError, PockEngineError) as exc:
        raise StepFileError(f"{where / META}: damaged ({type(exc).__name__}: {exc})") from None
    graph = read_graph(where / GRAPH, saved.graph_sha256)
    values = _with_zeros(graph, read_tensors(where / STATE), meta.get("zeros", []), where / META)
    check_state(graph, values, where / STATE)
    saved = saved.with_batch(_batch_values(graph, saved.batch_names, where / META))
    step = LoadedStep(where, saved, graph, values, backend or saved.backend)
    if saved.evaluator is not None:
        step._evaluator = _load_evaluator(step, where, saved.evaluator)
    return step


def _batch_values(graph: Graph, names: list[str], path: Path) -> tuple[Value, ...]:
    inputs = {v.name: v for v in graph.inputs if v.role is Role.INPUT}
    missing = [n for n in names if n not in inputs]
    if missing:
        raise StepFileError(f"{path}: batch inputs {missing} are not inputs of {GRAPH}")
    return tuple(inputs[n] for n in names)


def _load_evaluator(step: LoadedStep, where: Path, meta: Mapping[str, Any]) -> Evaluator:
    graph = read_graph(where / EVAL_GRAPH, str(meta["sha256"]))
    own = _with_zeros(graph, read_tensors(where / EVAL_STATE), meta.get("zeros", []), where / META)
    check_state(graph, {**own, **_store_types(step)}, where / EVAL_STATE)
    batch = _batch_values(graph, list(meta["batch"]), where / META)
    shared = {k: step.backend.share_numpy(v) for k, v in own.items()}
    return Evaluator(step, graph, batch, shared)


def _store_types(step: CompiledStep) -> dict[str, Array]:
    """Placeholders with the shapes and dtypes of the step's store (for ``check_state``)."""
    out = {}
    for name, value in step._store.items():
        array = step.backend.to_numpy(value)
        out[name] = np.broadcast_to(np.zeros((), array.dtype), array.shape)
    return out
