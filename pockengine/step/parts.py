"""What the compiler makes of a model before a backend binds it: ``StepParts``.

``parts_of`` imports a model with its frontend, resolves the scheme, quantizes the frozen
weights, fuses the forward for the backend's ops, appends the backward
(``training_graph``) and runs the training passes. ``TrainStep`` (``pockengine.step.compiler``)
binds the parts to a backend; a compile child (``pockengine.step.child``) writes them
to files instead, and the parent binds what it reads back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pockengine.autodiff import append_backward
from pockengine.backends import Backend
from pockengine.frontend.imported import ImportedModel, ModelInfo
from pockengine.ir import (
    GRAD_PREFIX,
    CompileError,
    Graph,
    GraphBuilder,
    Phase,
    Value,
    get_op,
    verify,
)
from pockengine.ir.arrays import Array
from pockengine.ir.rewrite import with_inputs
from pockengine.optim import Optimizer
from pockengine.passes import DEFAULT_PIPELINE, Pass, forward_passes, run_pipeline
from pockengine.passes.quantize import AS_GIVEN, FrozenWeights, quantize_frozen
from pockengine.passes.slices import sink_slices
from pockengine.plan.index_bounds import index_bounds
from pockengine.sparse.schemes import Resolution, Scheme, resolve_scheme
from pockengine.step.running import StepFacts

__all__ = [
    "Stages",
    "StepParts",
    "apply_resolution",
    "batchnorm_modules",
    "build_parts",
    "eval_batchnorms",
    "frozen_batchnorms",
    "gradients_graph",
    "parts_of",
    "training_graph",
]

log = logging.getLogger("pockengine.step.compiler")  # the messages users filter on
Stages = tuple[tuple[str, Graph], ...]
_NAMED_LOSS = {"onnx": "an ONNX", "keras": "a Keras"}  # frontends taking loss="..."


def _trained_rows(
    b: GraphBuilder, grads: dict[str, Value], rows: Mapping[str, int | None]
) -> dict[str, Value]:
    """Partial-channel params get the gradient of their first rows only (sink_slices then
    makes the backward compute just that slice)."""
    out = dict(grads)
    for name, k in rows.items():
        if k is not None and name in out:
            out[name] = b.call(
                "slice",
                out[name],
                axis=0,
                start=0,
                stop=k,
                step=1,
                source=f"{GRAD_PREFIX}{name}",
                phase=Phase.BACKWARD,
            )
    return out


def training_graph(
    forward: Graph, optimizer: Optimizer, rows: Mapping[str, int | None] | None = None
) -> tuple[Graph, dict[str, Array], tuple[str, ...]]:
    """Forward + backward + updates as one graph.

    Node order: the pure forward, ``skip = nonfinite(loss)``, the backward of the trained
    params, the forward's own effects (buffer statistics, the dropout seed), then the
    optimizer's updates. Every effect takes ``skip`` as its last input, so a step whose
    loss is NaN or inf writes nothing; it is computed right after the loss, so
    ``reorder_updates`` can still move updates into the backward. Returns the graph, the
    optimizer state's initial values and the params that get no gradient.
    """
    b = GraphBuilder("train_step")
    for v in forward.inputs:
        b.add_input(v)
    pure = [n for n in forward.nodes if not get_op(n.op).effectful]
    effects = [n for n in forward.nodes if get_op(n.op).effectful]
    for node in pure:
        b.append(node)
    skip = b.call("nonfinite", forward.outputs[0], source="loss", phase=Phase.FORWARD)
    trained = forward.trainable_params
    grads = _trained_rows(b, append_backward(b, pure, forward.outputs[0], trained), rows or {})
    for node in effects:
        b.append(node.replace(inputs=(*node.inputs, skip)))
    unreached = tuple(p.name for p in trained if p.name not in grads)
    pairs = [(p, grads[p.name]) for p in trained if p.name in grads]
    init = optimizer.build(b, pairs, skip) if pairs else {}
    return sink_slices(b.build(forward.outputs)), init, unreached


def gradients_graph(
    forward: Graph, rows: Mapping[str, int | None] | None = None
) -> tuple[Graph, tuple[str, ...]]:
    """Loss and gradients of the trained params (partial ones: their rows), no effects."""
    b = GraphBuilder("gradients")
    for v in forward.inputs:
        b.add_input(v)
    pure = [n for n in forward.nodes if not get_op(n.op).effectful]
    for node in pure:
        b.append(node)
    grads = append_backward(b, pure, forward.outputs[0], forward.trainable_params)
    grads = _trained_rows(b, grads, rows or {})
    return sink_slices(b.build([forward.outputs[0], *grads.values()])), tuple(grads)


@dataclass
class StepParts:
    """What the compiler makes before a backend binds it (``build_parts``): the fused
    forward graph, the final training graph, the facts and the initial values, with the
    optimizer, resolution, param table, scheme and passes they were made with. The pass
    stages are None where they were not kept (a step compiled in a child process,
    ``pockengine.step.child``, which also gives the forward graph as a function that
    parses it: ``TrainStep.forward`` calls it on first read)."""

    forward: Graph | Callable[[], Graph]  # a child's: parsed on first use (compile_fork)
    graph: Graph
    facts: StepFacts
    values: dict[str, Array]
    optimizer: Optimizer
    resolution: Resolution
    info: ModelInfo
    scheme: Scheme | None
    passes: tuple[Pass, ...]
    forward_stages: Stages | None = None
    stages: Stages | None = None


def build_parts(
    imported: ImportedModel,
    forward: Graph,
    optimizer: Optimizer,
    backend: Backend,
    resolution: Resolution,
    info: ModelInfo,
    scheme: Scheme | None = None,
    passes: Sequence[Pass] = DEFAULT_PIPELINE,
    frozen: FrozenWeights = AS_GIVEN,
) -> StepParts:
    """Quantize, fuse for ``backend``'s ops, add backward and updates, run ``passes``."""
    bounds = index_bounds(forward, imported.values)  # class targets, token ids (before quantizing)
    given = {
        ir: frozen.given[name] for ir, name in imported.state_names.items() if name in frozen.given
    }
    quant = quantize_frozen(verify(forward), imported.values, frozen.dtype, prequantized=given)
    fused = run_pipeline(quant.graph, forward_passes(backend.supported_ops()))
    graph, init, unreached = training_graph(fused.graph, optimizer, resolution.rows)
    if unreached:
        log.warning("the loss does not depend on %s: they get no update", list(unreached))
    result = run_pipeline(verify(graph), passes)
    trained = tuple(p.name for p in fused.graph.trainable_params)
    facts = StepFacts(
        imported.batch,
        dict(imported.state_names),
        dict(imported.aliases),
        quant.params,
        tuple(bounds),
        trained,
        imported.restructure,
    )
    return StepParts(
        fused.graph,
        result.graph,
        facts,
        {**quant.values, **init},
        optimizer,
        resolution,
        info,
        scheme,
        tuple(passes),
        fused.stages,
        result.stages,
    )


def parts_of(
    kind: str,
    model: Any,
    loss_fn: Callable[..., Any] | None,
    example_batch: Sequence[Any] | None,
    optimizer: Optimizer,
    scheme: Scheme | None,
    engine: Backend,
    pipeline: Sequence[Pass],
    frozen: FrozenWeights,
    loss: str | None,
    output: str | int | None,
    params: Sequence[str] | None,
) -> StepParts:
    """Import ``model`` with the frontend ``kind`` names and build the step's parts."""
    if kind in _NAMED_LOSS and loss is None:
        raise CompileError(
            f"{_NAMED_LOSS[kind]} model needs a named loss: "
            'loss="cross_entropy", "mse", "causal_lm" or "none"'
        )
    if kind == "onnx":
        assert loss is not None
        return _onnx_parts(
            model, loss, example_batch, optimizer, scheme, engine, output, params, pipeline, frozen
        )
    if kind == "keras":
        from pockengine.frontend.keras import import_keras, keras_model_info

        if example_batch is None:
            raise CompileError("compile(keras_model, loss=..., example_batch=...) needs a batch")
        batch, named = example_batch, str(loss)
        return _imported_parts(
            keras_model_info(model),
            lambda ev: import_keras(model, named, batch, output=output, eval_modules=ev),
            optimizer,
            scheme,
            engine,
            pipeline,
            frozen,
        )
    if loss_fn is None or example_batch is None:
        raise CompileError("compile(model, loss_fn, example_batch) needs loss_fn and example_batch")
    fn, batch = loss_fn, example_batch
    if kind == "jax":
        from pockengine.frontend.jax import import_jax, jax_model_info

        return _imported_parts(
            jax_model_info(model),
            lambda ev: import_jax(model, fn, batch, eval_modules=ev),
            optimizer,
            scheme,
            engine,
            pipeline,
            frozen,
        )
    from pockengine.frontend.torch import import_torch, torch_model_info

    return _imported_parts(
        torch_model_info(model),
        lambda ev: import_torch(model, fn, batch, eval_modules=ev),
        optimizer,
        scheme,
        engine,
        pipeline,
        frozen,
    )


def _imported_parts(
    info: ModelInfo,
    import_model: Callable[[set[str]], ImportedModel],
    optimizer: Optimizer,
    scheme: Scheme | None,
    engine: Backend,
    passes: Sequence[Pass] = DEFAULT_PIPELINE,
    frozen: FrozenWeights = AS_GIVEN,
) -> StepParts:
    """Resolve the scheme against ``info``, import (frozen BatchNorms in eval mode when the
    scheme asks), and build the step's parts."""
    resolution = resolve_scheme(scheme, info)
    eval_modules = eval_batchnorms(info, resolution)
    imported = import_model(eval_modules)
    if resolution.adapters:  # LoRA: the adapters' params join the graph before marking
        from pockengine.sparse.lora import insert_adapters

        imported = insert_adapters(imported, resolution.adapters)
    forward = apply_resolution(imported.graph, resolution)
    return build_parts(
        imported, forward, optimizer, engine, resolution, info, scheme, passes, frozen
    )


def _onnx_parts(
    model: Any,
    loss: str,
    example_batch: Sequence[Any] | None,
    optimizer: Optimizer,
    scheme: Scheme | None,
    engine: Backend,
    output: str | int | None,
    params: Sequence[str] | None,
    passes: Sequence[Pass],
    frozen: FrozenWeights,
) -> StepParts:
    from pockengine.frontend.onnx import import_onnx, load_onnx, onnx_model_info

    loaded = load_onnx(model, params)
    return _imported_parts(
        onnx_model_info(loaded),
        lambda ev: import_onnx(loaded, loss, example_batch, output, ev),
        optimizer,
        scheme,
        engine,
        passes,
        frozen,
    )


def batchnorm_modules(info: ModelInfo) -> set[str]:
    """The BatchNorm modules of the model (those with params)."""
    return {p.module for p in info.params if "batchnorm" in p.module_type.lower()}


def eval_batchnorms(info: ModelInfo, resolution: Resolution) -> set[str]:
    """The BatchNorm modules a step of ``resolution`` runs on their running statistics
    (exported in eval mode): every one under ``batchnorm="running"``, those that train
    nothing under ``frozen_bn="eval"``, none otherwise."""
    if resolution.running_bn:
        return batchnorm_modules(info)
    return frozen_batchnorms(info, resolution) if resolution.frozen_bn_eval else set()


def frozen_batchnorms(info: ModelInfo, resolution: Resolution) -> set[str]:
    """BatchNorm modules none of whose params train (they may run on running statistics)."""
    trained = {p.module for p in info.params if p.name in resolution.rows}
    return batchnorm_modules(info) - trained


def apply_resolution(forward: Graph, resolution: Resolution) -> Graph:
    """The forward graph with params marked trainable exactly as the scheme resolved."""
    names = {v.name for v in forward.params}
    unused = sorted(resolution.names - names)
    if unused:
        log.warning("trained params %s are not used by the loss", unused)
    params = [v.replace(trainable=v.name in resolution.rows) for v in forward.params]
    return verify(with_inputs(forward, params))
