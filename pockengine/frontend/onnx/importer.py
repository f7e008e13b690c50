"""ONNX frontend: an .onnx model plus a named loss -> a forward graph and its ModelInfo.

``load_onnx(path)`` (``model``) reads the model and sorts its initializers into
params, buffers and constants. ``import_onnx(model, loss, example_batch, output)`` lists
every node that has neither a converter nor only compile-time inputs, all at once, in one
``UnsupportedOpError``, then translates node by node: nodes computed only from constants
are folded (through their converter and the IR's reference kernels, else with ONNX's
reference evaluator), the others go through the flat converter table of ``converters``
(filled by ``math``, ``shape`` and ``nn``). The loss (``loss``) is
applied to the named output. Param names are the initializers' names (torch's
``state_dict`` names when the model was exported with ``optimize=False`` /
``do_constant_folding=False``), made valid IR names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pockengine.frontend.imported import ImportedModel, ModelInfo
from pockengine.frontend.loss import apply_loss, target_types
from pockengine.frontend.onnx import image, math, nn, rnn, shape  # noqa: F401  (fill the table)
from pockengine.frontend.onnx.converters import CONVERTERS, Ctx, Operand, ir_dtype, sanitize
from pockengine.frontend.onnx.info import model_info
from pockengine.frontend.onnx.model import OnnxModel, OnnxNode, load_onnx, require_onnx
from pockengine.ir import (
    CompileError,
    GraphBuilder,
    Role,
    TensorType,
    UnsupportedOpError,
    Value,
    get_op,
)
from pockengine.ir.arrays import Array

__all__ = [
    "OnnxModel",
    "OnnxNode",
    "check_supported",
    "import_onnx",
    "load_onnx",
    "onnx_model_info",
]

_NEVER_FOLD = frozenset(
    {
        "Dropout",
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)


def onnx_model_info(model: OnnxModel) -> ModelInfo:
    """Params with module paths from their names, repeated blocks, the head."""
    return model_info(model)


def _foldable(model: OnnxModel) -> set[str]:
    """Names of every value known at compile time (constants and what only they feed)."""
    known = {n for n, r in model.roles.items() if r is Role.CONST}
    for node in model.nodes:
        if node.op_type in ("Shape", "Size") or (
            node.op_type not in _NEVER_FOLD
            and node.domain in ("", "ai.onnx")
            and all(i == "" or i in known for i in node.inputs)
        ):
            known.update(o for o in node.outputs if o)
    return known


def check_supported(model: OnnxModel) -> None:
    """One UnsupportedOpError listing every node neither foldable nor convertible."""
    known = _foldable(model)
    missing: dict[tuple[str, str], None] = {}
    for node in model.nodes:
        if all(o in known for o in node.outputs if o):
            continue
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        if node.domain not in ("", "ai.onnx") or node.op_type not in CONVERTERS:
            missing[(op, node.name)] = None
    if missing:
        raise UnsupportedOpError("ONNX ops (the ONNX frontend has no converter)", list(missing))


def _fold_ir(node: OnnxNode, arrays: list[Array | None], opset: int) -> list[Array]:
    """Evaluate one node on constants through its converter and the IR's reference kernels."""
    b = GraphBuilder("fold")
    cx = Ctx(b)
    cx.opset, cx.n_outputs, cx.source = opset, len(node.outputs), node.name
    result = CONVERTERS[node.op_type](cx, list(arrays), node.attrs)
    results = result if isinstance(result, tuple) else (result,)
    env: dict[str, Array] = dict(cx.values)
    for n in b.nodes:
        outs = get_op(n.op).run([env[v.name] for v in n.inputs], n.attrs)
        env.update((v.name, np.asarray(a)) for v, a in zip(n.outputs, outs, strict=True))
    return [env[r.name] if isinstance(r, Value) else np.asarray(r) for r in results]


def _fold_reference(node: OnnxNode, arrays: list[Array | None], opset: int) -> list[Array]:
    """Evaluate one node on constants with ONNX's reference evaluator."""
    onnx = require_onnx()
    from onnx.reference import ReferenceEvaluator

    h = onnx.helper
    feeds = {n: a for n, a in zip(node.inputs, arrays, strict=True) if n and a is not None}
    ins = [
        h.make_tensor_value_info(n, h.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in feeds.items()
    ]
    outs = [h.make_empty_tensor_value_info(o) for o in node.outputs if o]
    graph = h.make_graph([node.proto], "fold", ins, outs)
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    results = ReferenceEvaluator(proto).run(None, feeds)
    return [np.asarray(r) for r in results]


def _fold(node: OnnxNode, arrays: list[Array | None], opset: int) -> list[Array]:
    """A node whose inputs are all known, evaluated now: by its converter and the IR's
    kernels when it has one, else (or when the converter refuses) by ONNX's reference."""
    if node.op_type in CONVERTERS:
        try:
            return _fold_ir(node, arrays, opset)
        except (CompileError, ValueError, TypeError, StopIteration):
            pass  # e.g. integer Div, which the IR lacks: the reference evaluator has it
    try:
        return _fold_reference(node, arrays, opset)
    except Exception as exc:
        raise CompileError(
            f"{node.op_type} at {node.name}: cannot evaluate it on constants: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _batch_array(item: Any) -> Array:
    if hasattr(item, "detach"):  # a torch tensor
        return np.asarray(item.detach().cpu().numpy())
    return np.asarray(item)


class _Translator:
    def __init__(self, model: OnnxModel, eval_modules: Iterable[str]) -> None:
        self.m = model
        self.b = GraphBuilder("forward")
        self.cx = Ctx(self.b)
        self.cx.opset = model.opset
        self.cx.eval_modules = frozenset(eval_modules)
        self.env: dict[str, Operand] = {}
        self.values: dict[str, Array] = {}
        self.state_names: dict[str, str] = {}

    def batch_inputs(self, example: list[Array] | None) -> list[Value]:
        taken = set(self.m.ir_names.values())
        batch = []
        for i, (name, elem, dims) in enumerate(self.m.inputs):
            dtype = ir_dtype(elem, f"input {name}")
            if example is not None:
                shape = tuple(example[i].shape)
                fits = len(dims) == len(shape) and all(
                    d in (None, s) for d, s in zip(dims, shape, strict=True)
                )
                if not fits or example[i].dtype != dtype.to_numpy():
                    raise CompileError(
                        f"example_batch entry {i} ({example[i].dtype}"
                        f"{list(shape)}) does not fit input {name} "
                        f"({dtype}{list(dims)})"
                    )
            elif None in dims:
                raise CompileError(
                    f"input {name} has symbolic dims {list(dims)}: pass example_batch"
                )
            else:
                shape = tuple(int(d) for d in dims if d is not None)
            ir = sanitize(name)
            ir = ir if ir not in taken else f"input.{ir}"
            v = self.b.input(ir, TensorType(shape, dtype), Role.INPUT)
            self.env[name] = v
            batch.append(v)
        return batch

    def initializers(self) -> None:
        for name, array in self.m.initializers.items():
            role = self.m.roles[name]
            if role is Role.CONST:
                self.env[name] = array
                continue
            ir = self.m.ir_names[name]
            t = TensorType(tuple(array.shape), ir_dtype(_elem_type(array), name))
            self.env[name] = self.b.input(ir, t, role, trainable=role is Role.PARAM)
            self.values[ir] = array
            self.state_names[ir] = name
            self.cx.module_of[ir] = ir.rsplit(".", 1)[0] if "." in ir else ""

    def nodes(self) -> None:
        for node in self.m.nodes:
            missing = [i for i in node.inputs if i and i not in self.env]
            if missing:
                raise CompileError(f"{node.op_type} at {node.name} reads undefined {missing}")
            ins = [self.env[i] if i else None for i in node.inputs]
            if node.op_type not in _NEVER_FOLD and not any(isinstance(x, Value) for x in ins):
                outs: Sequence[Operand] = _fold(node, ins, self.m.opset)  # type: ignore[arg-type]
            else:
                outs = self._convert(node, ins)
            for name, out in zip(node.outputs, outs, strict=False):
                if name:
                    self.env[name] = out

    def _convert(self, node: OnnxNode, ins: list[Operand]) -> Sequence[Operand]:
        self.cx.source = node.name
        self.cx.n_outputs = len(node.outputs)
        try:
            result = CONVERTERS[node.op_type](self.cx, ins, node.attrs)
        except CompileError as exc:
            raise CompileError(f"{node.op_type} at {node.name}: {exc}") from exc
        return result if isinstance(result, tuple) else (result,)

    def output(self, output: str | int | None) -> Value:
        names = self.m.outputs
        if output is None:
            if len(names) != 1:
                raise CompileError(f"the model has outputs {names}: name one with output=")
            output = names[0]
        if isinstance(output, int):
            if not -len(names) <= output < len(names):
                raise CompileError(f"output index {output} is out of range for {names}")
            output = names[output]
        if output not in self.env:
            raise CompileError(f"no output named {output!r}; outputs: {names}")
        return self.cx.value(self.env[output], f"output {output}")

    def targets(self, loss: str, out: Value, extra: list[Array]) -> list[Value]:
        types = target_types(loss, out, have_labels=bool(extra))
        if extra and len(extra) != len(types):
            raise CompileError(
                f"loss {loss!r} takes {len(types)} target tensors after the "
                f"model's inputs, got {len(extra)}"
            )
        targets = []
        for i, t in enumerate(types):
            if extra and (extra[i].shape != t.shape or extra[i].dtype != t.dtype.to_numpy()):
                raise CompileError(
                    f"loss {loss!r} needs a target {t}, got {extra[i].dtype}{list(extra[i].shape)}"
                )
            name = "labels" if loss == "causal_lm" else "target"
            targets.append(self.b.input(name if i == 0 else f"{name}{i}", t, Role.INPUT))
        return targets


def _elem_type(array: Array) -> int:
    onnx = require_onnx()
    return int(onnx.helper.np_dtype_to_tensor_dtype(array.dtype))


def import_onnx(
    model: OnnxModel,
    loss: str,
    example_batch: Sequence[Any] | None = None,
    output: str | int | None = None,
    eval_modules: Iterable[str] = (),
) -> ImportedModel:
    """Translate ``model`` and ``loss`` applied to ``output`` into a forward graph.

    ``example_batch`` holds the model's inputs (in graph order) and then the loss's targets;
    without it the inputs' static shapes are used and the targets are inferred from the
    loss. BatchNormalization layers of the modules in ``eval_modules`` use their running
    statistics.
    """
    check_supported(model)
    example = None if example_batch is None else [_batch_array(x) for x in example_batch]
    n = len(model.inputs)
    if example is not None and len(example) < n:
        raise CompileError(f"the model has {n} inputs; example_batch has {len(example)} entries")
    tr = _Translator(model, eval_modules)
    batch = tr.batch_inputs(example)
    tr.initializers()
    tr.nodes()
    out = tr.output(output)
    targets = tr.targets(loss, out, example[n:] if example is not None else [])
    labels = targets or ([batch[0]] if loss == "causal_lm" and batch else [])
    loss_value = apply_loss(tr.cx, loss, out, labels)
    tr.cx.finish_rng()
    graph = tr.b.build([loss_value])
    values = {**tr.values, **tr.cx.values}
    return ImportedModel(graph, values, tuple(batch + targets), tr.state_names)
