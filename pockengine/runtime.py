"""compile(): frontend -> scheme -> autodiff -> optimizer -> passes -> backend.

``TrainStep`` binds the resulting plan to a backend and holds the state:
parameters, buffers, optimizer state and the dropout seed. One call runs one
training step; nothing is traced or differentiated at run time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pockengine._libc import libc_function
from pockengine.autodiff import append_backward
from pockengine.backends import Backend, BackendSpec, Executable, get_backend
from pockengine.backends.mixed import MixedBackend
from pockengine.batch_checks import index_bounds
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
from pockengine.ir.rewrite import with_inputs
from pockengine.loading import LoadResult, StateError
from pockengine.ops.quant import Quantized
from pockengine.optim import SGD, Optimizer
from pockengine.passes import DEFAULT_PIPELINE, Pass, forward_passes, run_pipeline
from pockengine.passes.quantize import AS_GIVEN, FrozenWeights, quantize_frozen
from pockengine.passes.remat_budget import parse_budget, recomputation, with_budget
from pockengine.passes.slices import sink_slices
from pockengine.plan.report import Report, analyze
from pockengine.sparse.schemes import Resolution, Scheme, resolve_scheme
from pockengine.step_base import ON_NONFINITE, BatchError, CompiledStep, NonFiniteError, StepFacts

if TYPE_CHECKING:
    from pockengine.evaluator import Evaluator

__all__ = [
    "ON_NONFINITE",
    "BatchError",
    "LoadResult",
    "NonFiniteError",
    "StateError",
    "TrainStep",
    "apply_resolution",
    "compile",
    "frontend_of",
    "gradients_graph",
    "release_free_memory",
    "training_graph",
]

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]


def _trained_rows(
    b: GraphBuilder, grads: dict[str, Value], rows: Mapping[str, int | None]
) -> dict[str, Value]:
    """Partial-channel params get the gradient of their first rows only (sink_slices then
    makes the backward compute just that slice)."""
    out = dict(grads)
    for name, k in rows.items():
        if k is not None and name in out:
            out[name] = b.call("slice", out[name], axis=0, start=0, stop=k, step=1,
                               source=f"{GRAD_PREFIX}{name}", phase=Phase.BACKWARD)  # fmt: skip
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


class TrainStep(CompiledStep):
    """A compiled training step: ``step(*batch)`` trains once and returns the loss. Beside
    what it runs (``CompiledStep``) it keeps the compiler's facts: the forward graph and
    the pass stages, for ``gradients``, ``report`` and ``evaluator``."""

    def __init__(
        self,
        imported: ImportedModel,
        forward: Graph,
        optimizer: Optimizer,
        backend: Backend,
        resolution: Resolution,
        info: ModelInfo,
        scheme: Scheme | None = None,
        passes: Sequence[Pass] = DEFAULT_PIPELINE,
        frozen: FrozenWeights = AS_GIVEN,
    ) -> None:
        self.passes = tuple(passes)
        bounds = index_bounds(forward)  # class targets, token ids (before quantizing)
        given = {ir: frozen.given[name] for ir, name in imported.state_names.items()
                 if name in frozen.given}  # fmt: skip
        quant = quantize_frozen(verify(forward), imported.values, frozen.dtype, prequantized=given)
        fused = run_pipeline(quant.graph, forward_passes(backend.supported_ops()))
        self.forward = forward = fused.graph
        self.forward_stages = fused.stages
        self.optimizer, self.resolution = optimizer, resolution
        self.info, self.scheme = info, scheme
        graph, init, unreached = training_graph(forward, optimizer, resolution.rows)
        if unreached:
            log.warning("the loss does not depend on %s: they get no update", list(unreached))
        result = run_pipeline(verify(graph), self.passes)
        self.stages = result.stages
        trained = tuple(p.name for p in forward.trainable_params)
        facts = StepFacts(imported.batch, dict(imported.state_names), dict(imported.aliases),
                          quant.params, tuple(bounds), trained, imported.restructure)  # fmt: skip
        self._bind(result.graph, backend, facts, {**quant.values, **init})
        self._grad_exec: Executable | None = None
        self._grad_names: tuple[str, ...] = ()

    def gradients(self, *batch: Any) -> dict[str, Array]:
        """Gradients of the trained params on ``batch``; nothing is updated."""
        if self._grad_exec is None:
            graph, names = gradients_graph(self.forward, self.resolution.rows)
            self._grad_exec = self.backend.compile(run_pipeline(verify(graph), self.passes).graph)
            self._grad_names = names
        outs = self._grad_exec.run(self._store, self._feeds(batch))
        return {
            self._state_names.get(name, name): self.backend.to_numpy(out)
            for name, out in zip(self._grad_names, outs[1:], strict=True)
        }

    def evaluator(
        self, model: Any, eval_fn: Callable[..., Any], example_batch: Sequence[Any]
    ) -> Evaluator:
        """``eval_fn(model, *batch)`` compiled forward-only, in eval mode, on this step's
        backend and current values (``pockengine.evaluator``; torch models only)."""
        from pockengine.evaluator import compile_evaluator

        return compile_evaluator(self, model, eval_fn, example_batch)

    def report(self, depth: int | None = None) -> Report:
        """Trained params, FLOPs, saved activations, memory: this scheme beside full
        backprop of the same model (layers cut to ``depth`` path components)."""
        full = apply_resolution(self.forward, Resolution(dict.fromkeys(
            (p.name for p in self.forward.params), None)))  # fmt: skip
        full_graph, _, _ = training_graph(full, self.optimizer)
        # full backprop as it is, without this step's recomputation budget (which it could
        # miss, with a warning about a step nobody runs); ``recomputation`` says what it did
        full_graph = run_pipeline(full_graph, with_budget(self.passes, None)).graph
        scheme = self.scheme.to_dict() if self.scheme is not None else {"scheme": "requires_grad"}
        label = ", ".join(f"{k}={v}" for k, v in scheme.items())
        mixed = self.backend if isinstance(self.backend, MixedBackend) else None
        placement = mixed.placement(self.graph) if mixed is not None else None
        ours, full_figures = analyze(self.graph, depth), analyze(full_graph, depth)
        return Report(label, ours, full_figures, placement, recomputation(self.passes, self.stages))


def compile(
    model: Any,
    loss_fn: Callable[..., Any] | None = None,
    example_batch: Sequence[Any] | None = None,
    optimizer: Optimizer | None = None,
    scheme: Scheme | None = None,
    backend: BackendSpec = "numpy",
    *,
    loss: str | None = None,
    output: str | int | None = None,
    params: Sequence[str] | None = None,
    passes: Sequence[Pass] | None = None,
    frozen_dtype: str | None = None,
    quantized: Mapping[str, Quantized] | None = None,
    memory_budget: str | int | None = None,
) -> TrainStep:
    """Compile ``loss_fn(model, *batch)`` into one static training step.

    ``model`` is a torch ``nn.Module``, or for JAX the params pytree of
    ``loss_fn(params, *batch)`` (see ``pockengine.frontend.jax``), or a Keras model with a
    named ``loss`` (see ``pockengine.frontend.keras``).
    ``model`` may instead be an ONNX model (a path to an .onnx file, or a ModelProto):
    ``loss`` then names the loss ("cross_entropy", "mse", "causal_lm", or "none" when the
    output already is the loss) applied to the model output ``output`` (a name or an index;
    needed when the model has several), ``example_batch`` holds the model's inputs and then
    the loss's targets (optional when the inputs have static shapes), and ``params``
    optionally lists the initializers (names or globs) that are parameters; see
    ``pockengine.frontend.onnx``.
    ``backend`` names one of ``pockengine.backends.BACKENDS`` or is a configured ``Backend``
    instance (``TorchBackend(channels_last=False)``), or a list of them in priority order
    (``["onnxruntime", "numpy"]``: each node runs on the first that claims it, see
    ``pockengine.backends.mixed``; ``step.report()`` shows the split), or ``"auto"`` (the
    fastest of torch and onnxruntime per node, timed at compile time).
    ``passes`` are the training-graph passes, in order (default
    ``pockengine.passes.DEFAULT_PIPELINE``); leaving out ``passes.rematerialize`` keeps every
    saved activation instead of recomputing the cheap ones (faster, more memory).
    ``frozen_dtype`` ("int8": per output channel; "int4": 32-element groups with scales
    and offsets; None: float) stores the frozen weights of linear and embedding layers
    low-bit, dequantized one layer at a time inside the step (``pockengine.passes.quantize``,
    docs/quant.md); ``quantized`` gives weights already quantized (GGUF blocks, by model
    name: ``pockengine.finetune.gguf``), used as they are.
    ``memory_budget`` ("600MB", binary units, or bytes) caps the planned peak: saved
    activations, whole transformer blocks included, are recomputed in the backward pass at
    the least FLOPs until the plan fits (``pockengine.passes.remat_budget``; bit-identical
    results; a warning says how far the best plan is from a budget it cannot meet).
    """
    frozen = FrozenWeights(frozen_dtype, dict(quantized or {}))
    engine = get_backend(backend)
    pipeline = DEFAULT_PIPELINE if passes is None else tuple(passes)
    pipeline = with_budget(pipeline, parse_budget(memory_budget))
    kind = frontend_of(model)
    if kind == "onnx":
        if loss is None:
            raise CompileError('an ONNX model needs a named loss: loss="cross_entropy", "mse", '
                               '"causal_lm" or "none"')  # fmt: skip
        return _compile_onnx(model, loss, example_batch, optimizer, scheme, engine, output,
                             params, pipeline, frozen)  # fmt: skip
    if kind == "keras":
        from pockengine.frontend.keras import import_keras, keras_model_info

        if loss is None:
            raise CompileError('a Keras model needs a named loss: loss="cross_entropy", "mse", '
                               '"causal_lm" or "none"')  # fmt: skip
        if example_batch is None:
            raise CompileError("compile(keras_model, loss=..., example_batch=...) needs a batch")
        batch = example_batch
        return _compile_imported(
            keras_model_info(model),
            lambda ev: import_keras(model, loss, batch, output=output, eval_modules=ev),
            optimizer, scheme, engine, pipeline, frozen,
        )  # fmt: skip
    if loss_fn is None or example_batch is None:
        raise CompileError("compile(model, loss_fn, example_batch) needs loss_fn and example_batch")
    fn, batch = loss_fn, example_batch
    if kind == "jax":
        from pockengine.frontend.jax import import_jax, jax_model_info

        return _compile_imported(
            jax_model_info(model),
            lambda ev: import_jax(model, fn, batch, eval_modules=ev),
            optimizer, scheme, engine, pipeline, frozen,
        )  # fmt: skip
    from pockengine.frontend.torch import import_torch, torch_model_info

    return _compile_imported(
        torch_model_info(model),
        lambda ev: import_torch(model, fn, batch, eval_modules=ev),
        optimizer, scheme, engine, pipeline, frozen,
    )  # fmt: skip


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


def _compile_imported(
    info: ModelInfo,
    import_model: Callable[[set[str]], ImportedModel],
    optimizer: Optimizer | None,
    scheme: Scheme | None,
    engine: Backend,
    passes: Sequence[Pass] = DEFAULT_PIPELINE,
    frozen: FrozenWeights = AS_GIVEN,
) -> TrainStep:
    """Resolve the scheme against ``info``, import (frozen BatchNorms in eval mode when the
    scheme asks), and build the step."""
    resolution = resolve_scheme(scheme, info)
    eval_modules = frozen_batchnorms(info, resolution) if resolution.frozen_bn_eval else set()
    imported = import_model(eval_modules)
    if resolution.adapters:  # LoRA: the adapters' params join the graph before marking
        from pockengine.sparse.lora import insert_adapters

        imported = insert_adapters(imported, resolution.adapters)
    forward = apply_resolution(imported.graph, resolution)
    step = TrainStep(
        imported, forward, optimizer or SGD(), engine, resolution, info, scheme, passes, frozen
    )
    del imported, forward
    release_free_memory()
    return step


def release_free_memory() -> None:
    """Hand the heap that compiling freed (traced graphs, NumPy copies of the weights) back
    to the OS: glibc keeps freed blocks in the process, and the resident memory of a
    training run would carry them. A no-op where the C library has no malloc_trim."""
    import gc

    gc.collect()
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _compile_onnx(
    model: Any,
    loss: str,
    example_batch: Sequence[Any] | None,
    optimizer: Optimizer | None,
    scheme: Scheme | None,
    engine: Backend,
    output: str | int | None,
    params: Sequence[str] | None,
    passes: Sequence[Pass],
    frozen: FrozenWeights,
) -> TrainStep:
    from pockengine.frontend.onnx import import_onnx, load_onnx, onnx_model_info

    loaded = load_onnx(model, params)
    return _compile_imported(
        onnx_model_info(loaded),
        lambda ev: import_onnx(loaded, loss, example_batch, output, ev),
        optimizer, scheme, engine, passes, frozen,
    )  # fmt: skip


def frozen_batchnorms(info: ModelInfo, resolution: Resolution) -> set[str]:
    """BatchNorm modules none of whose params train (they may run on running statistics)."""
    modules: dict[str, bool] = {}
    for p in info.params:
        if "batchnorm" in p.module_type.lower():
            modules[p.module] = modules.get(p.module, False) or p.name in resolution.rows
    return {m for m, trained in modules.items() if not trained}


def apply_resolution(forward: Graph, resolution: Resolution) -> Graph:
    """The forward graph with params marked trainable exactly as the scheme resolved."""
    names = {v.name for v in forward.params}
    unused = sorted(resolution.names - names)
    if unused:
        log.warning("trained params %s are not used by the loss", unused)
    params = [v.replace(trainable=v.name in resolution.rows) for v in forward.params]
    return verify(with_inputs(forward, params))
