"""Export a training step: one ONNX model and a side file with its state.

The model is the training graph as ``emit`` writes it: batch tensors, params,
buffers, constants and optimizer state in; the loss and the new value of everything the
step writes out. Its metadata (``pockengine.*`` keys, JSON values) says how to call it:
the batch inputs in call order, the loss output, which output carries which input to the
next step, the model's own names of params and buffers, and the state file. The state
(the current value of every non-batch input) goes to ``<stem>.state.npz`` beside the
model, which numpy alone reads: ``pockengine/ort_runner.py`` needs nothing else but
onnxruntime.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.backends.onnx.emit import emit_onnx
from pockengine.ir import Graph, Value
from pockengine.ir.arrays import Array
from pockengine.safe_write import write_with

__all__ = ["FORMAT", "export_step", "state_path"]

FORMAT = "1"


def state_path(model_path: str | os.PathLike[str]) -> Path:
    """``train_step.onnx`` -> ``train_step.state.npz``."""
    path = Path(model_path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(f"{stem}.state.npz")


def export_step(
    path: str | os.PathLike[str],
    graph: Graph,
    state: Mapping[str, Array],
    batch: Sequence[Value],
    state_names: Mapping[str, str],
    aliases: Mapping[str, tuple[str, ...]],
) -> Path:
    """Write the model to ``path`` and the state beside it; returns the state file's path."""

    side = state_path(path)
    metadata = {
        "pockengine.format": FORMAT,
        "pockengine.batch": json.dumps([v.name for v in batch]),
        "pockengine.state_names": json.dumps(dict(state_names)),
        "pockengine.aliases": json.dumps({k: list(v) for k, v in aliases.items()}),
        "pockengine.state_file": side.name,
    }
    model, signature = emit_onnx(graph, metadata)
    extra = {
        "pockengine.loss": signature.outputs[0],
        "pockengine.updates": json.dumps(signature.updates),
    }
    for key, value in extra.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    missing = sorted({v.name for v in graph.inputs} - {v.name for v in batch} - set(state))
    if missing:
        raise ValueError(f"no value for the graph inputs {missing}")
    write_with(Path(path), lambda f: f.write(model.SerializeToString()))
    arrays: dict[str, Any] = {name: np.asarray(value) for name, value in state.items()}
    write_with(side, lambda f: np.savez(f, **arrays))
    return side
