"""Tracing a Keras model into a TF graph the frontend can read.

``trace(model, batch, replaced)`` calls the model in training mode inside a
``tf.function`` and returns its GraphDef as ``TfNode``s, with three facts the GraphDef
alone does not hold, gathered by wrapping each layer's ``call`` while tracing:

- the name scope of each layer call -> the layer's path, so every TF op can be traced back
  to the Keras layer that made it (error messages, sources of IR nodes);
- for the layers whose class is in ``replaced`` (BatchNormalization, LayerNormalization,
  Dropout: their TF expansion holds ``StopGradient``, seed-generator state and moving-average
  assignments that a layer-level lowering states better), the call becomes an ``Identity``
  marker of its input, remembered with the layer and its ``training`` flag;
- which graph placeholder holds which Keras variable (the captured resource handles).

The layers' own ``call`` is restored afterwards. ``fold(node, arrays)`` evaluates one node on
constant inputs with TensorFlow itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.ir import CompileError
from pockengine.ir.arrays import Array

__all__ = ["Marker", "TfNode", "Traced", "fold", "require_tensorflow", "trace"]

MARKER = "pockengine_layer"


def require_tensorflow() -> Any:
    """The ``tensorflow`` module, or a CompileError that says how to install it.

    TensorFlow's C++ start-up logging is quieted while it is first imported (it reads
    ``TF_CPP_MIN_LOG_LEVEL`` then); the variable is restored afterwards, so the user's
    process keeps its own environment."""
    key = "TF_CPP_MIN_LOG_LEVEL"
    before = os.environ.get(key)
    os.environ.setdefault(key, "2")
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise CompileError(
            'the Keras frontend needs TensorFlow: pip install "pockengine[tf]"'
        ) from exc
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    return tf


@dataclass(frozen=True)
class TfNode:
    op: str
    name: str
    inputs: tuple[str, ...]  # data inputs as "node:index"
    attrs: dict[str, Any]
    proto: Any


@dataclass(frozen=True)
class Marker:
    """A layer whose call was replaced by an Identity marker while tracing."""

    layer: Any
    training: bool


@dataclass
class Traced:
    nodes: list[TfNode]  # in graph order (topological)
    inputs: list[str]  # the batch placeholders' tensors
    outputs: list[str]  # the model's output tensors, flattened
    output_names: list[str]
    variables: dict[str, Any] = field(default_factory=dict)  # placeholder node -> variable
    scopes: dict[str, str] = field(default_factory=dict)  # name scope -> layer path
    markers: dict[str, Marker] = field(default_factory=dict)  # Identity node -> marker

    def layer_of(self, node_name: str) -> str:
        """The path of the innermost layer whose scope holds ``node_name`` ("" at the top)."""
        inside = [s for s in self.scopes if node_name.startswith(s + "/")]
        return self.scopes[max(inside, key=len)] if inside else ""


def tensor_name(ref: str) -> str:
    """A GraphDef input reference ("op", "op:1") as "op:index"."""
    return ref if ":" in ref else f"{ref}:0"


def _attr(value: Any, tf: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "list":
        fields = value.list.ListFields()
        if not fields:
            return []
        desc, items = fields[0]
        if desc.name == "type":
            return [tf.dtypes.as_dtype(t).name for t in items]
        return [v.decode() if isinstance(v, bytes) else v for v in items]
    if kind == "tensor":
        return np.array(tf.make_ndarray(value.tensor))
    if kind == "type":
        return str(tf.dtypes.as_dtype(value.type).name)
    if kind == "shape":
        return tuple(d.size for d in value.shape.dim)
    if kind == "func":
        return value.func.name
    raw = getattr(value, kind) if kind else None
    return raw.decode() if isinstance(raw, bytes) else raw


def _nodes(graph_def: Any, tf: Any) -> list[TfNode]:
    out = []
    for n in graph_def.node:
        inputs = tuple(tensor_name(i) for i in n.input if not i.startswith("^"))
        attrs = {k: _attr(v, tf) for k, v in n.attr.items()}
        out.append(TfNode(n.op, n.name, inputs, attrs, n))
    return out


def _wrap(
    layer: Any, root: Any, replaced: Collection[str], traced: Traced, tf: Any
) -> Callable[..., Any]:
    original = layer.call
    path = "" if layer is root else str(getattr(layer, "path", None) or layer.name)
    replace = layer is not root and type(layer).__name__ in replaced

    def call(*args: Any, **kwargs: Any) -> Any:
        traced.scopes.setdefault(tf.get_current_name_scope(), path)
        if not replace:
            return original(*args, **kwargs)
        if kwargs.get("mask") is not None:
            raise CompileError(f"{type(layer).__name__} {path}: a mask is not supported")
        x = args[0] if args else kwargs["inputs"]
        y = tf.identity(x, name=MARKER)
        traced.markers[y.op.name] = Marker(layer, bool(kwargs.get("training", False)))
        return y

    return call


@contextmanager
def _wrapped_calls(
    model: Any, replaced: Collection[str], traced: Traced, tf: Any
) -> Iterator[None]:
    layers = model._flatten_layers(include_self=True, recursive=True)
    saved = [(layer, layer.__dict__.get("call")) for layer in layers]
    for layer in layers:
        object.__setattr__(layer, "call", _wrap(layer, model, replaced, traced, tf))
    try:
        yield
    finally:
        for layer, own in saved:
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)


def _output_names(model: Any, structured: Any, count: int) -> list[str]:
    if isinstance(structured, dict):
        return [str(k) for k in sorted(structured)]
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == count else [str(i) for i in range(count)]


def trace(model: Any, batch: list[Array], replaced: Collection[str]) -> Traced:
    """The training-mode TF graph of ``model`` called on arrays shaped like ``batch``."""
    tf = require_tensorflow()
    specs = [
        tf.TensorSpec(a.shape, tf.as_dtype(a.dtype), name=f"input_{i}") for i, a in enumerate(batch)
    ]

    def forward(*xs: Any) -> Any:
        return model(xs[0] if len(xs) == 1 else list(xs), training=True)

    traced = Traced([], [], [], [])
    with _wrapped_calls(model, replaced, traced, tf):
        try:
            concrete = tf.function(forward).get_concrete_function(*specs)
        except CompileError:
            raise
        except Exception as exc:
            raise CompileError(
                f"tracing the Keras model failed: {type(exc).__name__}: {exc}"
            ) from exc
    graph = concrete.graph
    traced.nodes = _nodes(graph.as_graph_def(), tf)
    traced.inputs = [t.name for t in graph.inputs[: len(batch)]]
    traced.outputs = [t.name for t in concrete.outputs]
    structured = concrete.structured_outputs
    traced.output_names = _output_names(model, structured, len(concrete.outputs))
    handles = {id(v.handle): v for v in model.variables}
    for external, internal in graph.captures:
        if id(external) in handles:
            traced.variables[internal.op.name] = handles[id(external)]
    return traced


def fold(node: TfNode, arrays: list[Array]) -> list[Array]:
    """Evaluate ``node`` on constant inputs with TensorFlow (one small graph)."""
    tf = require_tensorflow()
    graph_def = tf.compat.v1.GraphDef()
    for i, array in enumerate(arrays):
        const = graph_def.node.add(name=f"in_{i}", op="Const")
        const.attr["dtype"].type = tf.as_dtype(array.dtype).as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(array))
    copy = graph_def.node.add()
    copy.CopyFrom(node.proto)
    del copy.input[:]
    copy.input.extend(f"in_{i}" for i in range(len(arrays)))
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(graph_def, name="")
        outputs = g.get_operation_by_name(node.name).outputs
        with tf.compat.v1.Session(graph=g) as session:
            return [np.asarray(r) for r in session.run(outputs)]
