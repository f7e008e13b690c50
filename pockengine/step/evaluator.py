"""Evaluation through the compiled forward, on a training step's own state.

``compile_evaluator(step, forward, model, eval_fn, example_batch)`` imports ``eval_fn(model,
*batch)`` with the frontend that built the step (torch only, so far: ONNX, JAX and Keras
steps raise a ``CompileError`` and their callers evaluate eagerly), with the whole model in
eval mode (no dropout; BatchNorm on its running statistics, the step's buffers), and
compiles it forward-only on the step's backend:

1. every param is frozen, and each weight the step stores quantized is read as the step's
   own codes (``quantize_frozen`` with the step's quantized params as given, so nothing is
   quantized again and the IR names are the step's);
2. the forward passes (``fuse_linear_cross_entropy`` turns a large-vocabulary loss into the
   chunked fused op), then folding, CSE, dead-code elimination and bias fusion;
3. the backend compiles it (its memory plan included).

The evaluator holds no weights: each call reads the step's current ``_store`` (shared, no
copy), so it sees every update the step has made. Only values the step does not hold
(constants of the eval graph, e.g. a non-persistent buffer the loss never read) are kept,
shared with the model's memory. Its output is the eval function's: a float scalar or a
small vector (a loss sum and a count of correct predictions, stacked).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pockengine.frontend import frontend_of
from pockengine.ir import CompileError, Graph, Role, TensorType, Value, verify
from pockengine.ir.arrays import Array
from pockengine.ir.rewrite import with_inputs
from pockengine.ops.quant import Quantized
from pockengine.passes import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_constants,
    forward_passes,
    fuse_linear_bias,
    run_pipeline,
)
from pockengine.passes.pipeline import Pass
from pockengine.passes.quantize import quantize_frozen
from pockengine.step.running import BatchError, CompiledStep

__all__ = ["EVAL_PIPELINE", "Evaluator", "compile_evaluator"]

log = logging.getLogger(__name__)

# After the forward passes: a forward-only graph has nothing to rematerialise or reorder.
EVAL_PIPELINE: tuple[Pass, ...] = (
    fold_constants,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fuse_linear_bias,
)


class Evaluator:
    """``evaluator(*batch)``: the eval function's result on ``batch`` (a NumPy array), from
    the step's current values. The batch shape is fixed (``batch_types``)."""

    def __init__(
        self, step: CompiledStep, graph: Graph, batch: tuple[Value, ...], own: dict[str, Any]
    ) -> None:
        self.step = step
        self.graph = graph
        self.batch_types: tuple[TensorType, ...] = tuple(v.type for v in batch)
        self._batch = batch
        self._own = own  # eval-only constants, in the backend's form
        self._state = tuple(v.name for v in graph.inputs if v.role is not Role.INPUT)
        self._exec = step.backend.compile(graph)

    @property
    def batch_size(self) -> int:
        return self.batch_types[0].shape[0]

    def __call__(self, *batch: Any) -> Array:
        if len(batch) != len(self._batch):
            raise BatchError(
                f"the evaluator takes {len(self._batch)} batch tensors, got {len(batch)}"
            )
        backend, store = self.step.backend, self.step._store
        feeds = {}
        for i, (value, item) in enumerate(zip(self._batch, batch, strict=True)):
            array = np.asarray(item)
            if array.shape != value.shape or array.dtype != value.dtype.to_numpy():
                raise BatchError(
                    f"evaluator batch entry {i}: compiled for {value.type}, got "
                    f"{array.dtype}{list(array.shape)}"
                )
            feeds[value.name] = backend.from_numpy(array)
        state = {n: store[n] if n in store else self._own[n] for n in self._state}
        out = self._exec.run(state, feeds)[0]
        return np.asarray(backend.to_numpy(out), dtype=np.float64)


def compile_evaluator(
    step: CompiledStep,
    forward: Graph,
    model: Any,
    eval_fn: Callable[..., Any],
    example_batch: Sequence[Any],
) -> Evaluator:
    """``eval_fn(model, *batch)`` compiled forward-only on ``step``'s backend, reading the
    step's state; ``model`` is the one the step was compiled from, ``forward`` the step's
    fused forward graph (``TrainStep.forward``). A ``CompileError`` when the frontend or
    the model cannot give an evaluation graph."""
    kind = frontend_of(model)
    if kind != "torch":
        raise CompileError(
            f"compiled evaluation is not supported for the {kind} frontend "
            "(evaluate the model eagerly)"
        )
    from pockengine.frontend.torch import import_torch

    with _eval_mode(model):
        imported = import_torch(model, eval_fn, example_batch, forward_only=True)
    adapters = step.resolution.adapters
    if adapters:  # LoRA: the eval graph computes what the adapted step computes
        from pockengine.sparse.lora import insert_adapters

        imported = insert_adapters(imported, adapters)
    graph = _frozen(imported.graph)
    quantized = _as_given(step, forward)
    graph = quantize_frozen(graph, {}, None, prequantized=quantized).graph
    graph = run_pipeline(graph, forward_passes(step.backend.supported_ops())).graph
    graph = run_pipeline(verify(graph), EVAL_PIPELINE).graph
    own = _own_values(step, forward, graph, imported.values)
    return Evaluator(step, graph, imported.batch, own)


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """The whole model in eval mode; each module's own mode restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _frozen(graph: Graph) -> Graph:
    return verify(with_inputs(graph, [v.replace(trainable=False) for v in graph.params]))


def _as_given(step: CompiledStep, forward: Graph) -> dict[str, Quantized]:
    """The step's quantized weights as ``quantize_frozen`` takes given ones: only their
    shapes and dtypes are read (placeholders, no data); the values come from the store."""
    types = {v.name: v.type for v in forward.inputs}
    out = {}
    for name, q in step._quantized.items():
        codes, scales, *offsets = (_placeholder(types[n]) for n in q.inputs)
        out[name] = Quantized(codes, scales, offsets[0] if offsets else None, q.scheme, q.group)
    return out


def _placeholder(t: TensorType) -> Array:
    return np.broadcast_to(np.zeros((), dtype=t.dtype.to_numpy()), t.shape)


def _own_values(
    step: CompiledStep, forward: Graph, graph: Graph, values: dict[str, Array]
) -> dict[str, Any]:
    """The eval graph's state inputs the step does not hold, checked against the step's
    types where it does."""
    types = {v.name: v.type for v in (*forward.inputs, *step.graph.inputs)}
    own = {}
    for v in graph.inputs:
        if v.role is Role.INPUT:
            continue
        if v.name in step._store:
            if v.name in types and types[v.name] != v.type:
                raise CompileError(
                    f"the eval graph reads {v.name} as {v.type}, the step holds {types[v.name]}"
                )
            continue
        if v.name not in values:
            raise CompileError(f"the eval graph reads {v.name}, which the step does not hold")
        if v.role is Role.PARAM:
            log.info("evaluation reads param %s from the model (the step does not hold it)", v.name)
        own[v.name] = step.backend.share_numpy(values[v.name])
    return own
