"""The onnxruntime backend: the whole training step as one ONNX model, run by ONNX Runtime.

``OrtBackend.compile`` emits the graph with ``emit`` (forward, pruned backward and
optimizer updates as standard operators; every effect becomes an output holding the new
value of what it writes) and opens one ``InferenceSession`` on it, with the CUDA
execution provider when onnxruntime has it and the CPU one otherwise.

The ``Store`` holds ``OrtValue``s on the session's device. A step binds them as inputs
with ``IOBinding`` (only those that changed since the last step are rebound) and binds
every written value's output to a second buffer of the same type, kept by the
executable; after the run the two swap, so the new values become the next step's inputs
without a copy and without an allocation. The batch is the only data copied in, the loss
the only data copied out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pockengine.backends.base import Backend, Executable, Store
from pockengine.backends.onnx.emit import emit_onnx, kernel_table
from pockengine.ir import CompileError, Graph, PockEngineError, TensorType
from pockengine.ir.arrays import Array

__all__ = ["OrtBackend", "OrtExecutable", "OrtRunError", "require_onnxruntime"]

_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


class OrtRunError(PockEngineError):
    """ONNX Runtime failed to run a step; the message names the failing node's IR op."""


def require_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise CompileError(
            "the onnxruntime backend needs onnx and onnxruntime: pip install onnx onnxruntime"
        ) from exc
    return onnxruntime


class OrtExecutable(Executable):
    """One graph as one ONNX model in one InferenceSession; ``run`` executes a step."""

    def __init__(self, graph: Graph, backend: OrtBackend) -> None:
        ort = backend.ort
        self.graph = graph
        self.backend = backend
        self.model, self.signature = emit_onnx(graph)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if backend.threads:
            options.intra_op_num_threads = backend.threads
        try:
            self.session = ort.InferenceSession(
                self.model.SerializeToString(), options, providers=backend.providers
            )
        except Exception as exc:
            raise CompileError(f"onnxruntime rejected the training graph: {exc}") from exc
        self._binding = self.session.io_binding()
        self._types: dict[str, TensorType] = {v.name: v.type for v in graph.inputs}
        self._bound: dict[str, Any] = {}  # input name -> the value bound to it now
        self._spare: dict[str, Any] = {}  # written input -> the buffer its next value goes to

    def _bind_inputs(self, store: Store, feeds: Mapping[str, Any]) -> None:
        for name in self.signature.inputs:
            if name in feeds:
                value = feeds[name]
            elif name in store:
                value = store[name]
            else:
                missing = [n for n in self.signature.inputs if n not in store and n not in feeds]
                raise CompileError(f"graph {self.graph.name} is missing inputs {missing}")
            if isinstance(value, np.ndarray):
                value = self.backend.from_numpy(value)
            if self._bound.get(name) is not value:
                self._binding.bind_ortvalue_input(name, value)
                self._bound[name] = value

    def _spare_for(self, name: str) -> Any:
        spare = self._spare.get(name)
        if spare is None:
            t = self._types[name]
            spare = self.backend.empty(t.shape, t.dtype.to_numpy())
            self._spare[name] = spare
        return spare

    def run(self, store: Store, feeds: Mapping[str, Any] | None = None) -> list[Any]:
        """One step: inputs from ``feeds`` and ``store``; written values swap into ``store``."""
        binding = self._binding
        self._bind_inputs(store, feeds or {})
        binding.clear_binding_outputs()
        for name in self.signature.outputs:
            binding.bind_output(name, self.backend.device)
        targets = {old: self._spare_for(old) for old in self.signature.updates}
        for old, new in self.signature.updates.items():
            binding.bind_ortvalue_output(new, targets[old])
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise OrtRunError(f"onnxruntime failed to run {self.graph.name}: {exc}") from exc
        for old, written in targets.items():
            previous = store[old]
            if isinstance(previous, np.ndarray):  # not ours to write into: allocate next time
                self._spare.pop(old)
            else:
                self._spare[old] = previous
            store[old] = written
        outputs = binding.get_outputs()
        return [outputs[i] for i in range(len(self.signature.outputs))]


class OrtBackend(Backend):
    """ONNX Runtime on ``device``: "auto" (CUDA when available), "cpu" or "cuda"."""

    name = "onnxruntime"

    def __init__(self, device: str = "auto", threads: int | None = None) -> None:
        self.ort = require_onnxruntime()
        available = self.ort.get_available_providers()
        if device == "auto":
            device = "cuda" if _CUDA in available else "cpu"
        if device == "cuda" and _CUDA not in available:
            raise CompileError(f"onnxruntime has no CUDA execution provider (it has {available})")
        if device not in ("cpu", "cuda"):
            raise CompileError(f"unknown onnxruntime device {device!r}: auto, cpu or cuda")
        self.device = device
        self.providers = [_CUDA, _CPU] if device == "cuda" else [_CPU]
        self.threads = threads

    def compile(self, graph: Graph) -> OrtExecutable:
        return OrtExecutable(graph, self)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        # a tuple: onnxruntime reads an empty *list* as shape [1]
        return self.ort.OrtValue.ortvalue_from_shape_and_type(tuple(shape), dtype, self.device, 0)

    def from_numpy(self, array: Array) -> Any:
        """An OrtValue that owns a copy of ``array`` (never aliases it)."""
        array = np.array(array, order="C")  # ascontiguousarray would make a 0-d array 1-d
        value = self.empty(array.shape, array.dtype)
        value.update_inplace(array)
        return value

    def supported_ops(self) -> frozenset[str]:
        return frozenset(kernel_table())

    def holds(self, value: Any) -> bool:
        return isinstance(value, self.ort.OrtValue) and value.device_name().lower() == self.device

    def to_numpy(self, tensor: Any) -> Array:
        """A copy: a CPU OrtValue's ``numpy()`` is a view of memory the next step reuses."""
        if isinstance(tensor, np.ndarray):
            return tensor
        return np.array(tensor.numpy(), copy=True)
