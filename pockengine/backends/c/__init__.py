"""The C backend: the training step compiled to C11 over one static arena.

``backend="c"`` in ``pockengine.compile``; ``export_c`` writes the stand-alone trainer
folder (``step.export(folder, target="c")``). See docs/c_backend.md.
"""

from __future__ import annotations

from pockengine.backends.c.backend import KERNELS, BoundStep, CBackend, CExecutable, claims
from pockengine.backends.c.driver import CCompileError, cache_dir, toolchain
from pockengine.backends.c.emit import CEmitError
from pockengine.backends.c.export import export_c, read_safetensors, write_safetensors

__all__ = [
    "KERNELS",
    "BoundStep",
    "CBackend",
    "CCompileError",
    "CEmitError",
    "CExecutable",
    "cache_dir",
    "claims",
    "export_c",
    "read_safetensors",
    "toolchain",
    "write_safetensors",
]
