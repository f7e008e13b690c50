"""Frontends translate models into the IR; they never optimise."""

from __future__ import annotations

import os
from typing import Any

from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo

__all__ = ["ImportedModel", "ModelInfo", "ParamInfo", "frontend_of"]


def frontend_of(model: Any) -> str:
    """Which frontend takes ``model``: "onnx" (a path or ModelProto), "keras" (a Keras
    model), "torch" (an ``nn.Module``) or "jax" (anything else: a pytree of params for a
    JAX ``loss_fn(params, *batch)``)."""
    if isinstance(model, str | os.PathLike) or type(model).__name__ == "ModelProto":
        return "onnx"
    modules = {cls.__module__.split(".", 1)[0] for cls in type(model).__mro__}
    if modules & {"keras", "tf_keras"}:
        return "keras"
    if "torch" in modules:
        return "torch"
    return "jax"
