"""What a compiled training step is once it runs: a graph bound to a backend, and its state.

``CompiledStep`` is the running half of a step, shared by the ``TrainStep`` that
``pockengine.compile`` builds (it adds the compiler's own facts: the forward graph, the
pass stages, ``gradients`` and the report it computes) and the ``LoadedStep`` that
``pockengine.load_step`` reads from a step artifact (``pockengine.step.artifact``), which ran no
compiler at all. Everything here needs only the final training graph, the backend, the
store of values and ``StepFacts``: the names, batch types and checks the compiler worked
out and the artifact writes down. NumPy only; no frontend is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pockengine.backends import Backend
from pockengine.frontend.imported import ModelInfo
from pockengine.ir import CompileError, Graph, PockEngineError, Role, get_op
from pockengine.ir.arrays import Array
from pockengine.optim import LR, Optimizer
from pockengine.passes.quantize import QuantizedParam
from pockengine.passes.remat_budget import budget_of
from pockengine.plan.index_bounds import IndexBound, out_of_range
from pockengine.sparse.schemes import Resolution, Scheme
from pockengine.step.module_tensors import InPlace, ModuleHomes, bind_in_place
from pockengine.step.strict_load import LoadResult, StateError, load_into_module, match_arrays

if TYPE_CHECKING:
    from pockengine.ir import Value
    from pockengine.plan.report import Report

__all__ = [
    "ON_NONFINITE",
    "BatchError",
    "CompiledStep",
    "NonFiniteError",
    "StepFacts",
    "copies_deferred",
]

ON_NONFINITE = ("raise", "skip")
_DEFERRED = contextvars.ContextVar("copies_deferred", default=False)
_RESULT_FIELDS = ("missing", "unexpected", "mismatched")


class BatchError(PockEngineError):
    """A batch that does not fit the step: shapes or dtypes other than the example batch's,
    or class targets outside ``[0, classes)``."""


class NonFiniteError(PockEngineError):
    """A step whose loss was NaN or inf: it applied no update (params, optimizer state,
    buffers and the step count are as before it)."""


@dataclass(frozen=True)
class StepFacts:
    """What the compiler worked out that running the step needs, beside its graph.

    ``batch``: the batch inputs in call order; ``state_names``: IR name -> model name of
    every param and persistent buffer; ``aliases``: every name of a tied tensor under its
    first; ``quantized``: float params stored as codes (by IR name); ``index_bounds``:
    the range checks of class targets and token ids; ``trained``: IR names of the
    trained params, in order; ``restructure``: the model's own state structure (JAX)."""

    batch: tuple[Value, ...]
    state_names: dict[str, str]
    aliases: dict[str, tuple[str, ...]]
    quantized: dict[str, QuantizedParam]
    index_bounds: tuple[IndexBound, ...]
    trained: tuple[str, ...]
    restructure: Callable[[dict[str, Array]], Any] | None = field(default=None, compare=False)


@contextlib.contextmanager
def copies_deferred() -> Iterator[None]:
    """Steps bound inside share every value they write (the torch model's trained params
    included) until their first step: for a process that compiles a step to save it
    (``finetune.compiling.compile_child``), which then never holds the trained params twice. The
    caller must not change the model's params before that step."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class CompiledStep(ABC):
    """A training step bound to a backend: ``step(*batch)`` trains once and returns the
    loss. Holds params, buffers, optimizer state and the dropout seed (``_store``)."""

    graph: Graph
    backend: Backend
    optimizer: Optimizer
    info: ModelInfo
    resolution: Resolution
    scheme: Scheme | None

    def _bind(
        self,
        graph: Graph,
        backend: Backend,
        facts: StepFacts,
        values: dict[str, Array],
        module: Any | None = None,
    ) -> None:
        """Bind ``graph`` to ``backend`` with ``values`` as its state, shared (``values``
        is emptied as it goes). A value the step writes is copied once: a writable array
        (handed over: the optimizer state's zeros, values read from a file) just before
        the first step writes anything (``_own_written``), so a step that is only saved
        never touches the zeros; a read-only one (the caller's memory: a torch model's
        params) here, or likewise late inside ``copies_deferred()``. 4-D values are
        copied here: a backend may store them in another layout than the one it shares.
        With a torch ``module`` (``in_place=True``) the module's own tensors are the store
        of the params and buffers the step writes, where the backend can share them
        (``pockengine.step.module_tensors``)."""
        self.graph, self.backend = graph, backend
        self._batch = facts.batch
        self._state_names = dict(facts.state_names)
        self._aliases = dict(facts.aliases)
        self._ir_by_name: dict[str, str] | None = None
        self._quantized = dict(facts.quantized)
        self._trained_ir = facts.trained
        self._restructure = facts.restructure
        self._index_bounds: dict[str, list[IndexBound]] = {}
        for bound in facts.index_bounds:
            self._index_bounds.setdefault(bound.input, []).append(bound)
        written = {n.inputs[i].name for n in graph.nodes for i in get_op(n.op).mutates}
        self._written = frozenset(written)
        self._store: dict[str, Any] = {}
        self._lent: set[str] = set()  # written values still shared with their source
        self._homes: ModuleHomes | None = None
        if module is not None:
            self._homes = bind_in_place(
                module, graph, facts.state_names, values, backend, self._store
            )
        for name in list(values):
            value = values.pop(name)
            late = np.ndim(value) != 4 and (_DEFERRED.get() or np.asarray(value).flags.writeable)
            if name in written and not late:
                self._store[name] = backend.from_numpy(value)
                continue
            self._store[name] = backend.share_numpy(value)
            if name in written:
                self._lent.add(name)
        self._exec = backend.compile(graph)
        self.calls = 0  # steps run, skipped ones included: the number errors name
        self.skipped_steps = 0  # steps whose loss was not finite (they applied no update)
        self._on_nonfinite = "raise"

    @property
    def facts(self) -> StepFacts:
        bounds = tuple(b for group in self._index_bounds.values() for b in group)
        return StepFacts(
            self._batch,
            dict(self._state_names),
            dict(self._aliases),
            dict(self._quantized),
            bounds,
            self._trained_ir,
            self._restructure,
        )

    @abstractmethod
    def report(self, depth: int | None = None) -> Report:
        """Trained params, FLOPs, saved activations, memory: this scheme beside full
        backprop of the same model (layers cut to ``depth`` path components)."""

    # -- running ---------------------------------------------------------------
    def _feeds(self, batch: Sequence[Any]) -> dict[str, Any]:
        if len(batch) != len(self._batch):
            raise BatchError(f"expected {len(self._batch)} batch tensors, got {len(batch)}")
        feeds = {}
        for i, (value, item) in enumerate(zip(self._batch, batch, strict=True)):
            array = _to_numpy(item)
            want = value.dtype.to_numpy()
            if array.shape != value.shape or array.dtype != want:
                got = f"{array.dtype}{list(array.shape)}"
                raise BatchError(
                    f"batch entry {i}: compiled for {value.type}, got {got}; shapes and dtypes "
                    "are fixed at compile time (compile again for another shape)"
                )
            for bound in self._index_bounds.get(value.name, ()):
                problem = out_of_range(array, bound)
                if problem is not None:
                    raise BatchError(f"batch entry {i}: {problem}; nothing was trained")
            feeds[value.name] = self.backend.feed(array)
        return feeds

    def __call__(self, *batch: Any) -> float:
        """Train once on ``batch``; returns the loss. A NaN or inf loss applies no update
        (checked in the graph before any update runs): a ``NonFiniteError``, or with
        ``on_nonfinite = "skip"`` the step counts in ``skipped_steps`` and returns it."""
        feeds = self._feeds(batch)
        self._own_written()
        self.calls += 1
        loss = float(self.backend.to_numpy(self._exec.run(self._store, feeds)[0]))
        if self._homes is not None:
            self._homes.sync(self._store, self.backend)
        if not math.isfinite(loss):
            self.skipped_steps += 1
            if self._on_nonfinite == "raise":
                raise NonFiniteError(
                    f"step {self.calls}: the loss is {loss}; the step applied no update "
                    "(params, optimizer state, buffers and step count are unchanged). Look for "
                    "NaN/inf in the batch, or lower the learning rate"
                )
        return loss

    def _own_written(self) -> None:
        """Copy the written values the store still shares (``_bind``), one at a time: the
        source of each (the model's memory, a zero block) is dropped as soon as it is."""
        for name in sorted(self._lent):
            self._store[name] = self.backend.from_numpy(self.backend.to_numpy(self._store[name]))
        self._lent.clear()

    @property
    def in_place(self) -> InPlace | None:
        """For a step compiled with ``in_place=True``: which of the module's values it
        trains in the module's own memory and which it copies, and why; else None."""
        return None if self._homes is None else self._homes.report

    @property
    def on_nonfinite(self) -> str:
        """What a step with a NaN/inf loss does (it never updates): "raise" a
        ``NonFiniteError`` (the default), or "skip" (counted in ``skipped_steps``)."""
        return self._on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, value: str) -> None:
        if value not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {value!r}")
        self._on_nonfinite = value

    def _read(self, name: str, copy: bool = True) -> Array:
        """``name``'s value: a fresh array, or with ``copy=False`` the backend's own memory
        where it can lend it (CPU torch, NumPy, C: valid until the next step)."""
        quantized = self._quantized.get(name)
        if quantized is not None:  # the float values the step computes with
            return quantized.dequantized(lambda n: self.backend.to_numpy(self._store[n]))
        value = self.backend.to_numpy(self._store[name])
        return np.array(value, copy=True) if copy else value

    @property
    def source(self) -> str | None:
        """The generated code of the training step where the backend writes one (C for
        ``backend="c"``, Python for ``"torch"``): one statement per node under its IR text."""
        source = getattr(self._exec, "source", None)
        return source if isinstance(source, str) else None

    # -- state -----------------------------------------------------------------
    @property
    def lr(self) -> float:
        return float(self._read(LR)) if LR in self._store else self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """A finite learning rate > 0; anything else is refused before it is stored."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise StateError(f"step.lr must be a number, got {value!r}") from None
        if not (math.isfinite(number) and number > 0):
            raise StateError(f"step.lr must be a finite number > 0, got {value!r}")
        self._store[LR] = self.backend.from_numpy(np.asarray(number, dtype=np.float32))
        self._lent.discard(LR)

    @property
    def trained(self) -> tuple[str, ...]:
        return tuple(self._state_names.get(n, n) for n in self._trained_ir)

    def state_dict(self) -> Any:
        """Params and persistent buffers, named as in ``model.state_dict()`` (tied ones
        under each of their names); for a JAX model, the params pytree it was compiled from
        (``flat_state_dict()`` gives the flat form for every frontend)."""
        flat = self.flat_state_dict()
        return flat if self._restructure is None else self._restructure(flat)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Every param and persistent buffer the step holds, by model name (tied tensors
        under their first name)."""
        return tuple(self._state_names.values())

    @property
    def written(self) -> tuple[str, ...]:
        """The params and persistent buffers (model names) that a step writes: the trained
        params and the buffers it updates (running statistics). The others keep the values
        the step was compiled with (or was given through ``load_state``)."""
        return tuple(name for ir, name in self._state_names.items() if ir in self._written)

    def flat_state_dict(
        self, names: Iterable[str] | None = None, *, copy: bool = True
    ) -> dict[str, Array]:
        """Params and persistent buffers as ``{model name: array}``; only ``names`` (first
        names of tied tensors, e.g. ``written``) when given. ``copy=False`` lends the step's
        own memory where the backend can (read-only use before the next step: writing a
        checkpoint without a second copy of everything it holds)."""
        wanted = None if names is None else set(names)
        out = {}
        for ir, name in self._state_names.items():
            if wanted is not None and name not in wanted:
                continue
            value = self._read(ir, copy)
            for i, alias in enumerate(self._aliases.get(name, (name,))):
                out[alias] = value.copy() if copy and i else value
        return out

    def aliases(self, name: str) -> tuple[str, ...]:
        """Every model name of the tensor first named ``name`` (a tied tensor has several;
        the first is ``name``)."""
        return self._aliases.get(name, (name,))

    @property
    def quantized(self) -> tuple[str, ...]:
        """The weights the step stores quantized, by model name (tied ones under their first
        name)."""
        return tuple(self._state_names.get(ir, ir) for ir in self._quantized)

    def value(self, name: str, *, copy: bool = True) -> Array:
        """One param or persistent buffer by model name (any of a tied tensor's names), as
        ``flat_state_dict`` gives it (a quantized weight as its floats; ``copy=False`` lends
        the step's own memory where the backend can)."""
        ir = self._ir_of_name().get(name)
        if ir is None:
            raise KeyError(f"the step holds no param or buffer named {name!r}")
        return self._read(ir, copy)

    def _ir_of_name(self) -> dict[str, str]:
        if self._ir_by_name is None:
            self._ir_by_name = {
                alias: ir for ir, name in self._state_names.items() for alias in self.aliases(name)
            }
        return self._ir_by_name

    def state_specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """The shape and dtype of every entry of ``flat_state_dict()`` (quantized weights as
        their floats, tied ones under each name), from the step's types: no value is
        dequantized or copied."""
        out = {}
        for ir, name in self._state_names.items():
            spec = self._spec(ir)
            for alias in self._aliases.get(name, (name,)):
                out[alias] = spec
        return out

    def optimizer_state(self, *, copy: bool = True) -> dict[str, Array]:
        """The optimizer's state by IR name (``copy=False``: as ``flat_state_dict``)."""
        state = self.graph.inputs_with_role(Role.STATE)
        return {v.name: self._read(v.name, copy) for v in state}

    def _spec(self, ir: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        quantized = self._quantized.get(ir)
        if quantized is not None:
            return quantized.type.shape, quantized.type.dtype.to_numpy()
        current = self.backend.to_numpy(self._store[ir])
        return tuple(current.shape), current.dtype

    def load_state(
        self,
        params: Mapping[str, Any] | None = None,
        optimizer: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
    ) -> LoadResult:
        """Set params/buffers (model names, as ``state_dict()`` gives them) and optimizer
        state (as ``optimizer_state()`` gives it), e.g. to resume from a checkpoint.

        Strict (the default): each given mapping must name every param and buffer (every
        optimizer state value), no other name, with the same shapes and dtype kinds; a
        ``StateError`` lists what differs and nothing is written. ``strict=False`` loads
        what fits and returns the rest."""
        by_model = {name: ir for ir, name in self._state_names.items()}
        for alias, canonical in self.info.canonical.items():
            if canonical in by_model:
                by_model.setdefault(alias, by_model[canonical])
        updates: dict[str, Array] = {}
        results = []
        if params is not None:
            expected = {ir: self._spec(ir) for ir in self._state_names}
            fitting, result = match_arrays(
                params,
                expected,
                what="params and buffers",
                strict=strict,
                key=by_model.get,
                label=lambda ir: self._state_names[ir],
            )
            updates.update(fitting)
            results.append(result)
        if optimizer is not None:
            state = {v.name: self._spec(v.name) for v in self.graph.inputs_with_role(Role.STATE)}
            fitting, result = match_arrays(optimizer, state, what="optimizer state", strict=strict)
            updates.update(fitting)
            results.append(result)
        for ir, array in updates.items():
            self._write(ir, array)
        return LoadResult(*(sum((getattr(r, f) for r in results), ()) for f in _RESULT_FIELDS))

    def _write(self, ir: str, array: Array) -> None:
        quantized = self._quantized.get(ir)
        if quantized is None:
            self._store[ir] = self.backend.from_numpy(array)
            self._lent.discard(ir)
            if self._homes is not None:  # into the module's memory too
                self._homes.sync(self._store, self.backend, (ir,))
            return
        if np.array_equal(array, self._read(ir)):  # unchanged (a resume): codes as they are
            return
        dtypes = {n: self._spec(n)[1] for n in quantized.inputs}
        for name, codes in quantized.quantized(array, dtypes).items():  # requantized
            self._store[name] = self.backend.from_numpy(codes)

    # -- writing it out ----------------------------------------------------------
    def export(
        self,
        path: str | os.PathLike[str],
        *,
        target: str = "onnx",
        layouts: str | os.PathLike[str] | None = None,
    ) -> Path:
        """Write this training step with its current params, buffers and optimizer state.
        ``target="onnx"``: one ONNX model (``path``) plus ``<stem>.state.npz`` beside it, to
        run with ``pockengine/ort_runner.py`` wherever numpy and onnxruntime are installed;
        returns the path of the state file. ``target="c"``: a self-contained folder
        (``path``) whose ``make`` builds a stand-alone ``./train`` needing only libc and
        libm (see ``pockengine.backends.c.export``; a step compiled with a ``memory_budget``
        keeps the trainer's plan within it; ``layouts``: the layout file a trainer of this
        step measured, ``./train --tune``'s ``conv-layouts.txt``, whose layouts replace
        the heuristic's); returns the folder. ``target="step"``: the step artifact
        (``save``)."""
        if layouts is not None and target != "c":
            raise CompileError(f"export: layouts= goes with target='c', not {target!r}")
        if target == "step":
            return self.save(path)
        state = {v.name: self._read(v.name) for v in self.graph.inputs if v.role is not Role.INPUT}
        if target == "c":
            from pockengine.backends.c.export import export_c

            bounds = tuple(b for group in self._index_bounds.values() for b in group)
            budget = budget_of(getattr(self, "passes", ()))  # pe.compile(memory_budget=...)
            return export_c(
                path, self.graph, state, self._batch, self._state_names, bounds, budget, layouts
            )
        if target != "onnx":
            raise CompileError(f"unknown export target {target!r}; use 'onnx', 'c' or 'step'")
        from pockengine.backends.onnx.export import export_step

        return export_step(path, self.graph, state, self._batch, self._state_names, self._aliases)

    @abstractmethod
    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the step artifact into ``folder`` (``pockengine.step.artifact``, which the
        concrete steps call: ``TrainStep.save``, ``LoadedStep.save``); returns the folder."""

    def load_into(self, model: Any, *, strict: bool = True) -> LoadResult:
        """Write the trained values back into a torch module. Strict (the default): the
        module must have exactly this step's params and buffers, with the same shapes and
        dtype kinds, or a ``StateError`` says what differs and nothing is written;
        ``strict=False`` writes what fits and returns the rest. LoRA adapters are merged
        into the weights they adapt (the module has none)."""
        state = self.flat_state_dict()
        if self.resolution.adapters:
            from pockengine.sparse.lora import merge_adapters

            state = merge_adapters(state, self.resolution.adapters)
        return load_into_module(state, model, strict=strict)


def _to_numpy(item: Any) -> Array:
    if isinstance(item, np.ndarray):
        return item
    if hasattr(item, "detach"):
        return np.asarray(item.detach().cpu().numpy())
    return np.asarray(item)
