"""compile(): frontend -> scheme -> autodiff -> optimizer -> passes -> backend.

``TrainStep`` binds the resulting plan to a backend and holds the state:
parameters, buffers, optimizer state and the dropout seed. One call runs one
training step; nothing is traced or differentiated at run time.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pockengine._libc import libc_function
from pockengine.backends import Backend, BackendSpec, Executable, get_backend
from pockengine.backends.mixed import MixedBackend
from pockengine.frontend import frontend_of
from pockengine.ir import CompileError, Graph, verify
from pockengine.ir.arrays import Array
from pockengine.ops.quant import Quantized
from pockengine.optim import SGD, Optimizer
from pockengine.passes import DEFAULT_PIPELINE, Pass, run_pipeline
from pockengine.passes.quantize import FrozenWeights
from pockengine.passes.remat_budget import parse_budget, recomputation, with_budget
from pockengine.plan.report import Report, analyze
from pockengine.sparse.schemes import Resolution, Scheme
from pockengine.step.artifact import save_step
from pockengine.step.child import compile_forked, compile_mode
from pockengine.step.evaluator import Evaluator, compile_evaluator
from pockengine.step.parts import (
    Stages,
    StepParts,
    apply_resolution,
    frozen_batchnorms,
    gradients_graph,
    parts_of,
    training_graph,
)
from pockengine.step.running import ON_NONFINITE, BatchError, CompiledStep, NonFiniteError
from pockengine.step.strict_load import LoadResult, StateError

__all__ = [
    "ON_NONFINITE",
    "BatchError",
    "LoadResult",
    "NonFiniteError",
    "StateError",
    "TrainStep",
    "apply_resolution",
    "compile",
    "frozen_batchnorms",
    "gradients_graph",
    "release_free_memory",
    "training_graph",
]


class TrainStep(CompiledStep):
    """A compiled training step: ``step(*batch)`` trains once and returns the loss. Beside
    what it runs (``CompiledStep``) it keeps the compiler's facts: the forward graph and
    the pass stages, for ``gradients``, ``report`` and ``evaluator``."""

    @classmethod
    def bound(cls, parts: StepParts, backend: Backend, module: Any | None = None) -> TrainStep:
        """The step ``parts`` make on ``backend`` (``parts.values`` is emptied); with a
        torch ``module``, trained in its own tensors (``pockengine.step.module_tensors``)."""
        step = cls.__new__(cls)
        step._adopt(parts, backend, module)
        return step

    def _adopt(self, parts: StepParts, backend: Backend, module: Any | None = None) -> None:
        self.passes, self._forward = parts.passes, parts.forward
        self.optimizer, self.resolution = parts.optimizer, parts.resolution
        self.info, self.scheme = parts.info, parts.scheme
        self._forward_stages, self._stages = parts.forward_stages, parts.stages
        self._bind(parts.graph, backend, parts.facts, parts.values, module)
        self._grad_exec: Executable | None = None
        self._grad_names: tuple[str, ...] = ()

    @property
    def forward(self) -> Graph:
        """The fused forward graph (for ``gradients``, ``report``, ``evaluator``). A step
        compiled in a child keeps it as compressed IR text until it is first read."""
        if not isinstance(self._forward, Graph):
            self._forward = self._forward()
        return self._forward

    @property
    def stages(self) -> Stages:
        """The training graph after each pass (``run_pipeline``'s, input first). A step
        compiled in a child process did not keep them: they are made again here, once."""
        if self._stages is None:
            graph, _, _ = training_graph(self.forward, self.optimizer, self.resolution.rows)
            self._stages = run_pipeline(verify(graph), self.passes).stages
        return self._stages

    @property
    def forward_stages(self) -> Stages:
        """The forward graph before and after each forward pass; a step compiled in a child
        process has only the fused forward (``(("forward", graph),)``)."""
        return self._forward_stages or (("forward", self.forward),)

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
        backend and current values (``pockengine.step.evaluator``; torch models only)."""
        return compile_evaluator(self, self.forward, model, eval_fn, example_batch)

    def save(self, folder: str | os.PathLike[str], evaluator: Evaluator | None = None) -> Path:
        """Write the step artifact into ``folder``: the training graph as IR text, the
        store as safetensors, everything else as JSON (``pockengine.step.artifact``);
        ``pockengine.load_step(folder)`` runs it without the compiler. ``evaluator`` (a
        compiled ``Evaluator`` of this step) is saved beside it. Returns the folder."""
        return save_step(self, folder, evaluator)

    def report(self, depth: int | None = None) -> Report:
        """Trained params, FLOPs, saved activations, memory: this scheme beside full
        backprop of the same model (layers cut to ``depth`` path components)."""
        full = apply_resolution(
            self.forward, Resolution(dict.fromkeys((p.name for p in self.forward.params), None))
        )
        full_graph, _, _ = training_graph(full, self.optimizer)
        # full backprop as it is, without this step's recomputation budget (which it could
        # miss, with a warning about a step nobody runs); ``recomputation`` says what it did
        full_graph = run_pipeline(full_graph, with_budget(self.passes, None)).graph
        scheme = self.scheme.to_dict() if self.scheme is not None else {"scheme": "requires_grad"}
        label = ", ".join(f"{k}={v}" for k, v in scheme.items())
        mixed = self.backend if isinstance(self.backend, MixedBackend) else None
        placement = mixed.placement(self.graph) if mixed is not None else None
        ours, full_figures = analyze(self.graph, depth), analyze(full_graph, depth)
        kernels = tuple(getattr(self._exec, "kernel_choices", ()))  # CBackend(tune=True)
        memory = getattr(self._exec, "memory", None)  # a backend's own plan (C)
        redone = recomputation(self.passes, self.stages)
        return Report(label, ours, full_figures, placement, redone, kernels, memory)


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
    compile_in: str | None = None,
    in_place: bool = False,
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
    name: ``pockengine.tasks.gguf``), used as they are.
    ``memory_budget`` ("600MB", binary units, or bytes) caps the planned peak: saved
    activations, whole transformer blocks included, are recomputed in the backward pass at
    the least FLOPs until the plan fits (``pockengine.passes.remat_budget``; bit-identical
    results; a warning says how far the best plan is from a budget it cannot meet).
    ``compile_in`` ("child" or "process"; default: ``PE_COMPILE_IN``, else "child" for
    torch and ONNX models on POSIX while no JAX runtime or CUDA has started and TensorFlow
    is not loaded, else "process") says where the compiler runs: "child" forks, compiles
    in the child and reads its step back, so this process keeps no memory the compiler
    used (``pockengine.step.child``); each child starts ``torch.export`` cold, so a
    process that compiles many steps is faster with "process".
    ``in_place`` (torch models): the step trains the module's own param and buffer
    tensors, as a torch optimizer does, instead of copies of them: training holds one
    copy of them, and the module holds the trained values after every step. Values a
    backend cannot share (a 4-D weight the torch backend stores channels-last, another
    dtype, ONNX Runtime or CUDA) are copied and written back after each step, with a
    warning; ``step.in_place`` says which (``pockengine.step.module_tensors``).
    """
    frozen = FrozenWeights(frozen_dtype, dict(quantized or {}))
    engine = get_backend(backend)
    pipeline = DEFAULT_PIPELINE if passes is None else tuple(passes)
    # the backend's own rewrites (the C backend's low-bit products) last, so that a memory
    # budget plans the graph the backend runs
    pipeline = (*pipeline, *getattr(engine, "lowering_passes", lambda: ())())
    budget = parse_budget(memory_budget)
    pipeline = with_budget(pipeline, budget)
    if budget is not None:  # the backend's own additions to the plan fit it too
        engine = engine.under_budget(budget)
    kind, optim = frontend_of(model), optimizer or SGD()
    if not isinstance(in_place, bool):  # "no" or "false" would be truthy
        raise CompileError(f"in_place must be True or False, got {in_place!r}")
    if in_place and kind != "torch":
        raise CompileError(
            f"in_place=True trains a torch module's own tensors; a {kind} "
            "model has none the step can write (leave in_place out)"
        )
    module = model if in_place else None

    def build() -> StepParts:
        return parts_of(
            kind,
            model,
            loss_fn,
            example_batch,
            optim,
            scheme,
            engine,
            pipeline,
            frozen,
            loss,
            output,
            params,
        )

    if compile_mode(compile_in, kind) == "child":
        named = model if kind == "torch" else None
        parts = compile_forked(build, named, optim, scheme, pipeline)
        step = TrainStep.bound(parts, engine, module)
        del parts
        _trim_heap()  # what reading the parts freed (no collection: reading made no cycles)
        return step
    step = TrainStep.bound(build(), engine, module)
    release_free_memory()
    return step


def release_free_memory() -> None:
    """Hand the heap that compiling freed (traced graphs, NumPy copies of the weights) back
    to the OS: glibc keeps freed blocks in the process, and the resident memory of a
    training run would carry them. A no-op where the C library has no malloc_trim."""
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """Hand glibc's freed heap back to the OS (``malloc_trim``); a no-op elsewhere."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
