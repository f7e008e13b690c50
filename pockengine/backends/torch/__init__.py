"""The torch backend: a graph compiles to one generated Python function calling ATen.

``backend`` holds ``TorchBackend`` and merges the kernel tables; ``codegen`` writes the
function's source; ``kernels`` and ``kernels_*`` are the tables (op name -> the lines of
ATen calls); ``heap`` decides where the run hands freed heap pages back and plans the
workspace.
"""

from __future__ import annotations

from pockengine.backends.torch.backend import (
    KERNELS,
    TorchBackend,
    TorchExecutable,
    TorchKernelError,
    keep_freed_heap,
)

__all__ = ["KERNELS", "TorchBackend", "TorchExecutable", "TorchKernelError", "keep_freed_heap"]
