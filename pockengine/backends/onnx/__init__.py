"""The ONNX Runtime backend: the whole training step as one ONNX model.

``backend`` holds ``OrtBackend``, which runs the model in one ONNX Runtime session;
``emit`` writes a graph as one ONNX model from the kernel tables ``kernels`` and
``kernels_*``; ``export`` writes a step's model and its state for ``pockengine export``.
"""

from __future__ import annotations

from pockengine.backends.onnx.backend import OrtBackend, OrtExecutable, OrtRunError
from pockengine.backends.onnx.emit import emit_onnx
from pockengine.backends.onnx.export import export_step

__all__ = ["OrtBackend", "OrtExecutable", "OrtRunError", "emit_onnx", "export_step"]
