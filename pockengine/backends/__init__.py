"""Backends: kernel tables that execute a training graph."""

from __future__ import annotations

from pockengine.backends.base import Backend, Executable, Store, check_ops
from pockengine.ir import CompileError

__all__ = ["BACKENDS", "Backend", "Executable", "Store", "check_ops", "get_backend"]

BACKENDS = ("numpy", "torch", "torch-cuda", "onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda")


def get_backend(name: str | Backend) -> Backend:
    """The backend called ``name`` (or ``name`` itself when it already is a ``Backend``, such
    as ``TorchBackend(keep_heap=False)``); its heavy imports happen only here."""
    if isinstance(name, Backend):
        return name
    if name == "numpy":
        from pockengine.backends.numpy_backend import NumpyBackend

        return NumpyBackend()
    if name in ("torch", "torch-cuda", "torch-cpu"):
        from pockengine.backends.torch_backend import TorchBackend

        return TorchBackend(device="cuda" if name == "torch-cuda" else "cpu")
    if name in ("onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda"):
        from pockengine.backends.onnx_backend import OrtBackend

        return OrtBackend(device={"onnxruntime": "auto"}.get(name, name.rsplit("-", 1)[-1]))
    raise CompileError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
