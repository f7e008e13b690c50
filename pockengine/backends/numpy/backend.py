"""The NumPy backend: the reference interpreter, and the oracle for every other backend.

It runs the nodes in graph order with each op's reference kernel. Values are
dropped after their last read, so the interpreter's memory follows the plan's
liveness. Effectful ops return the new values of the inputs they write; the
backend stores them in the caller's state mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.backends.base import Backend, Executable, Store
from pockengine.ir import Graph, Role, get_op
from pockengine.ir.arrays import Array
from pockengine.ir.errors import CompileError
from pockengine.plan.liveness import last_reads

__all__ = ["NumpyBackend", "NumpyExecutable", "evaluate"]


@dataclass(frozen=True, slots=True)
class _Step:
    kernel: Callable[..., Any]
    attrs: dict[str, Any]
    reads: tuple[str, ...]
    writes: tuple[str, ...]  # results, or the written inputs of an effectful op
    drops: tuple[str, ...]  # values read here for the last time
    label: str


class NumpyExecutable(Executable):
    """A graph bound to reference kernels; ``run`` executes one call of it."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        keep = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
        last_read = last_reads(graph)
        steps = []
        for i, node in enumerate(graph.nodes):
            opdef = get_op(node.op)
            writes = (
                tuple(node.inputs[j].name for j in opdef.mutates)
                if opdef.effectful
                else tuple(v.name for v in node.outputs)
            )
            dying = {v.name for v in node.inputs if last_read[v.name] == i}
            drops = tuple(sorted(dying - keep))
            steps.append(
                _Step(
                    opdef.kernel,
                    dict(node.attrs),
                    tuple(v.name for v in node.inputs),
                    writes,
                    drops,
                    f"{node.op} at {node.source or '?'}",
                )
            )
        self._steps = tuple(steps)
        self._outputs = tuple(v.name for v in graph.outputs)
        self._inputs = tuple(v for v in graph.inputs)

    def run(self, store: Store, feeds: Mapping[str, Any] | None = None) -> list[Array]:
        """Run once on ``store`` (params, state; written inputs are replaced in it) and
        ``feeds`` (batch inputs; may also be in ``store``)."""
        feeds = feeds or {}
        missing = [v.name for v in self._inputs if v.name not in store and v.name not in feeds]
        if missing:
            raise CompileError(f"graph {self.graph.name} is missing inputs {missing}")
        values: dict[str, Array] = {
            v.name: feeds[v.name] if v.name in feeds else store[v.name] for v in self._inputs
        }
        for step in self._steps:
            out = step.kernel(*(values[n] for n in step.reads), **step.attrs)
            outs = out if isinstance(out, tuple | list) else (out,)
            for name, array in zip(step.writes, outs, strict=True):
                values[name] = np.asarray(array)
            for name in step.drops:
                del values[name]
        for v in self._inputs:
            if v.role in (Role.PARAM, Role.BUFFER, Role.STATE):
                store[v.name] = values[v.name]
        return [values[n] for n in self._outputs]


class NumpyBackend(Backend):
    """The reference backend: NumPy arrays and each op's reference kernel."""

    name = "numpy"

    def compile(self, graph: Graph) -> NumpyExecutable:
        return NumpyExecutable(graph)

    def from_numpy(self, array: Array) -> Array:
        return np.array(array, order="C")  # a copy the store owns

    def share_numpy(self, array: Array) -> Array:
        """``array`` itself when C-ordered, made read-only: a value the step only reads."""
        if not array.flags.c_contiguous:
            return self.from_numpy(array)
        shared = array.view()
        shared.flags.writeable = False
        return shared

    def share_written(self, array: Array) -> Array:
        """``array`` itself: the kernels return new values, and the step copies them into
        it after each run (``pockengine.step.module_tensors``)."""
        return array

    def to_numpy(self, tensor: Any) -> Array:
        return np.asarray(tensor)

    def holds(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)


def evaluate(graph: Graph, feeds: MutableMapping[str, Array]) -> list[Array]:
    """Run ``graph`` once on ``feeds`` (every input) with the reference kernels."""
    return NumpyExecutable(graph).run(feeds)
