"""Backends: kernel tables that execute a training graph."""

from __future__ import annotations

from collections.abc import Sequence

from pockengine.backends.base import Backend, Executable, Store, check_ops
from pockengine.ir import CompileError

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendSpec",
    "Executable",
    "Store",
    "check_ops",
    "get_backend",
]

BACKENDS = (
    "numpy", "torch", "torch-cuda", "onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda", "c",
    "auto",
)  # fmt: skip


BackendSpec = str | Backend | Sequence[str | Backend]


def get_backend(name: BackendSpec) -> Backend:
    """The backend called ``name`` (or ``name`` itself when it already is a ``Backend``, such
    as ``TorchBackend(keep_heap=True)``); its heavy imports happen only here. A list of
    them (``["onnxruntime", "numpy"]``) runs each node on the first that claims it
    (``backends.mixed``); ``"auto"`` times the torch and onnxruntime kernels of each node
    at compile time and keeps the fastest (``backends.auto``)."""
    if isinstance(name, Backend):
        return name
    if not isinstance(name, str):
        from pockengine.backends.mixed import MixedBackend

        members = [get_backend(n) for n in name]
        return members[0] if len(members) == 1 else MixedBackend(members)
    if name == "auto":
        from pockengine.backends.auto import AutoBackend

        return AutoBackend()
    if name == "numpy":
        from pockengine.backends.numpy.backend import NumpyBackend

        return NumpyBackend()
    if name in ("torch", "torch-cuda", "torch-cpu"):
        from pockengine.backends.torch.backend import TorchBackend

        return TorchBackend(device="cuda" if name == "torch-cuda" else "cpu")
    if name in ("onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda"):
        from pockengine.backends.onnx.backend import OrtBackend

        return OrtBackend(device={"onnxruntime": "auto"}.get(name, name.rsplit("-", 1)[-1]))
    if name == "c":
        from pockengine.backends.c import CBackend

        return CBackend()
    raise CompileError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
