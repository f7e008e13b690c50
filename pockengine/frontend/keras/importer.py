"""Keras frontend: a Keras 3 (or tf_keras) model plus a named loss -> a forward graph.

``import_keras(model, loss, example_batch)`` traces ``model(x, training=True)`` into a TF
graph (``trace``), lists every TF op that has neither a converter nor only constant
inputs, all at once, with the Keras layer it came from (one ``UnsupportedOpError``), then
translates node by node: constant-only nodes are evaluated by TensorFlow, variable reads
become params (trainable-kind variables) or buffers (moving statistics), marked layers go
through ``layers`` and the other ops through the flat table of ``converters`` (filled by
``math``, ``shape`` and ``nn``). The loss (``loss``: cross_entropy, mse,
causal_lm, none) is applied to the chosen output; Keras keeps classes on the last axis.

``keras_model_info(model)`` gives the params (IR names: the variable paths with dots), their
layers and layer classes, the layers that repeat and the last ``Dense`` as the head.
Without TensorFlow both raise a CompileError naming ``pip install "pockengine[tf]"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pockengine.frontend.imported import ImportedModel, ModelInfo
from pockengine.frontend.keras import image, math, nn, shape  # noqa: F401  (fill the table)
from pockengine.frontend.keras.converters import TF_CONVERTERS, Operand, ir_dtype
from pockengine.frontend.keras.layers import (
    LAYER_CONVERTERS,
    KerasCtx,
    ir_name,
    keras_info,
    owners,
    variable_role,
)
from pockengine.frontend.keras.trace import (
    TfNode,
    Traced,
    fold,
    require_tensorflow,
    tensor_name,
    trace,
)
from pockengine.frontend.loss import apply_loss, target_types
from pockengine.ir import CompileError, GraphBuilder, Role, TensorType, UnsupportedOpError, Value
from pockengine.ir.arrays import Array

__all__ = ["check_supported", "import_keras", "keras_model_info", "require_tensorflow"]

_VARIABLE_OPS = frozenset({"ReadVariableOp", "AssignVariableOp"})
_STATIC = frozenset({"Shape", "Size", "Rank"})  # known from static shapes
_ROOTS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


def _require_keras_model(model: Any) -> None:
    require_tensorflow()
    if not hasattr(model, "_flatten_layers") or not hasattr(model, "variables"):
        raise CompileError(f"expected a Keras model, got {type(model).__name__}")


def keras_model_info(model: Any) -> ModelInfo:
    """Params with their layers and layer classes, repeated blocks, the head."""
    _require_keras_model(model)
    return keras_info(model)


def _needed(traced: Traced) -> list[TfNode]:
    """The nodes the outputs or a variable assignment depend on, in graph order."""
    by_name = {n.name: n for n in traced.nodes}
    stack = [t.split(":")[0] for t in traced.outputs]
    stack += [n.name for n in traced.nodes if n.op in _ROOTS]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(t.split(":")[0] for t in by_name[name].inputs)
    return [n for n in traced.nodes if n.name in seen]


def _stateful(op: str) -> bool:
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(op)
    return op_def is None or bool(op_def.is_stateful)


def _known(nodes: list[TfNode], traced: Traced) -> set[str]:
    """Nodes whose every output is known at compile time."""
    known: set[str] = set()
    for node in nodes:
        if node.op in _STATIC or node.op == "Const":
            known.add(node.name)
        elif node.name in traced.markers or node.op == "Placeholder" or _stateful(node.op):
            continue
        elif all(t.split(":")[0] in known for t in node.inputs):
            known.add(node.name)
    return known


def check_supported(traced: Traced, nodes: list[TfNode]) -> None:
    """One UnsupportedOpError listing every op neither foldable nor convertible."""
    known = _known(nodes, traced)
    missing: dict[tuple[str, str], None] = {}
    for node in nodes:
        if node.name in known or node.name in traced.markers or node.op == "Placeholder":
            continue
        if node.op not in TF_CONVERTERS and node.op not in _VARIABLE_OPS:
            missing[(node.op, traced.layer_of(node.name) or "<model>")] = None
    if missing:
        loops = any(op in ("While", "StatelessWhile") for op, _ in missing)
        hint = (
            "A Keras recurrent layer (LSTM, GRU, SimpleRNN) traces to a While loop over "
            "its time steps: build it with unroll=True, which traces each step."
        )
        raise UnsupportedOpError(
            "TF ops (the Keras frontend has no converter)", list(missing), hint if loops else ""
        )


class _Translator:
    def __init__(self, model: Any, traced: Traced, eval_modules: Iterable[str]) -> None:
        self.model, self.t = model, traced
        self.b = GraphBuilder("forward")
        self.cx = KerasCtx(self.b, self.variable)
        self.cx.eval_modules = frozenset(eval_modules)
        self.env: dict[str, Operand] = {}
        self.resources: dict[str, Any] = {}  # tensor of a resource placeholder -> variable
        self.params: dict[int, Value] = {}
        self.values: dict[str, Array] = {}
        self.state_names: dict[str, str] = {}
        self.owner = owners(model)

    def variable(self, v: Any) -> Value:
        """The graph input holding Keras variable ``v`` (made on first use)."""
        if id(v) not in self.params:
            name = ir_name(v.path)
            array = np.array(v.numpy())
            role = variable_role(self.owner, v)
            t = TensorType(tuple(array.shape), ir_dtype(array.dtype.name, v.path))
            value = self.b.input(name, t, role, trainable=role is Role.PARAM and v.trainable)
            self.params[id(v)] = value
            self.values[name] = array
            self.state_names[name] = str(v.path)
        return self.params[id(v)]

    def batch(self, arrays: list[Array]) -> list[Value]:
        out = []
        for i, (tensor, array) in enumerate(zip(self.t.inputs, arrays, strict=True)):
            t = TensorType(tuple(array.shape), ir_dtype(array.dtype.name, f"input {i}"))
            self.env[tensor] = value = self.b.input(f"input_{i}", t, Role.INPUT)
            out.append(value)
        return out

    def nodes(self, nodes: list[TfNode]) -> None:
        known = _known(nodes, self.t)
        for node in nodes:
            if node.op == "Placeholder":
                if node.name in self.t.variables:
                    self.resources[f"{node.name}:0"] = self.t.variables[node.name]
                continue
            path = self.t.layer_of(node.name)
            self.cx.source = ir_name(path) if path else "<model>"
            try:
                outs = self._node(node, node.name in known)
            except CompileError as exc:
                raise CompileError(f"{node.op} {node.name} (layer {path!r}): {exc}") from exc
            for i, out in enumerate(outs):
                self.env[f"{node.name}:{i}"] = out

    def _node(self, node: TfNode, known: bool) -> Sequence[Operand]:
        ins = [self.env.get(t) for t in node.inputs]
        if node.name in self.t.markers:
            marker = self.t.markers[node.name]
            convert = LAYER_CONVERTERS[type(marker.layer).__name__]
            return (convert(self.cx, marker.layer, self.cx.value(ins[0]), marker.training),)
        if node.op == "ReadVariableOp":
            return (self.variable(self.resources[node.inputs[0]]),)
        if node.op == "AssignVariableOp":
            self._assign(self.resources[node.inputs[0]], ins[1])
            return ()
        if known and node.op not in _STATIC:
            return fold(node, [np.asarray(x) for x in ins])
        self.cx.n_outputs = 1
        result = TF_CONVERTERS[node.op](self.cx, ins, node.attrs)
        return result if isinstance(result, tuple) else (result,)

    def _assign(self, v: Any, new: Operand) -> None:
        target = self.variable(v)
        if target.role is not Role.BUFFER:
            raise CompileError(f"assigning to the trainable variable {v.path} is not supported")
        self.cx.effect("assign", target, self.cx.cast(self.cx.value(new), target.dtype))

    def output(self, output: str | int | None) -> Value:
        names, tensors = self.t.output_names, self.t.outputs
        if output is None and len(tensors) != 1:
            raise CompileError(f"the model has outputs {names}: name one with output=")
        index = 0 if output is None else output
        if isinstance(index, str):
            if index not in names:
                raise CompileError(f"no output named {index!r}; outputs: {names}")
            index = names.index(index)
        if not -len(tensors) <= index < len(tensors):
            raise CompileError(f"output index {index} is out of range for {names}")
        return self.cx.value(self.env[tensor_name(tensors[index])], "model output")


def _model_inputs(model: Any) -> int:
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return 1
    return len(inputs) if inputs else 1


def _as_array(item: Any) -> Array:
    if hasattr(item, "detach"):
        return np.asarray(item.detach().cpu().numpy())
    return np.asarray(item)


def _classes_on_axis_1(cx: KerasCtx, out: Value, loss: str) -> Value:
    """Keras keeps classes last; the cross_entropy loss wants them on axis 1."""
    if loss != "cross_entropy" or out.type.rank <= 2:
        return out
    rank = out.type.rank
    return cx.call("transpose", out, perm=(0, rank - 1, *range(1, rank - 1)))


def _targets(tr: _Translator, loss: str, out: Value, extra: list[Array]) -> list[Value]:
    types = target_types(loss, out, have_labels=bool(extra))
    if len(extra) != len(types):
        raise CompileError(
            f"loss {loss!r} takes {len(types)} target tensors after the "
            f"model's inputs, got {len(extra)}"
        )
    targets = []
    for i, (t, array) in enumerate(zip(types, extra, strict=True)):
        if array.shape != t.shape or array.dtype != t.dtype.to_numpy():
            raise CompileError(
                f"loss {loss!r} needs a target {t}, got {array.dtype}{list(array.shape)}"
            )
        name = "labels" if loss == "causal_lm" else "target"
        targets.append(tr.b.input(name if i == 0 else f"{name}{i}", t, Role.INPUT))
    return targets


def import_keras(
    model: Any,
    loss: str,
    example_batch: Sequence[Any],
    output: str | int | None = None,
    eval_modules: Iterable[str] = (),
) -> ImportedModel:
    """Translate ``loss`` applied to ``model``'s output ``output`` into a forward graph.

    ``example_batch`` holds the model's inputs (in ``model.inputs`` order), then the loss's
    targets. BatchNormalization layers whose path (dotted) is in ``eval_modules`` run on
    their moving statistics.
    """
    _require_keras_model(model)
    arrays = [_as_array(x) for x in example_batch]
    n = _model_inputs(model)
    if len(arrays) < n:
        raise CompileError(f"the model has {n} inputs; example_batch has {len(arrays)} entries")
    traced = trace(model, arrays[:n], LAYER_CONVERTERS)
    nodes = _needed(traced)
    check_supported(traced, nodes)
    tr = _Translator(model, traced, eval_modules)
    batch = tr.batch(arrays[:n])
    tr.nodes(nodes)
    out = _classes_on_axis_1(tr.cx, tr.output(output), loss)
    targets = _targets(tr, loss, out, arrays[n:])
    labels = targets or ([batch[0]] if loss == "causal_lm" else [])
    loss_value = apply_loss(tr.cx, loss, out, labels)
    tr.cx.finish_rng()
    graph = tr.b.build([loss_value])
    values = {**tr.values, **tr.cx.values}
    return ImportedModel(graph, values, tuple(batch + targets), tr.state_names)
