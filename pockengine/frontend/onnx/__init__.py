"""The ONNX frontend: an ONNX model (a path or a ``ModelProto``) and a named loss -> IR.

``importer`` drives the translation; ``model`` loads and checks the model, ``info`` reads
its ``ModelInfo``; ``converters`` holds the flat table keyed by ONNX op type, which
``image``, ``math``, ``nn``, ``rnn`` and ``shape`` fill.
"""

from __future__ import annotations

from pockengine.frontend.onnx.importer import (
    OnnxModel,
    OnnxNode,
    check_supported,
    import_onnx,
    load_onnx,
    onnx_model_info,
)

__all__ = [
    "OnnxModel",
    "OnnxNode",
    "check_supported",
    "import_onnx",
    "load_onnx",
    "onnx_model_info",
]
