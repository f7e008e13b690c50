"""PyTorch frontend: torch.export of model-plus-loss, core ATen, a flat converter table.

``import_torch(model, loss_fn, example_batch)`` exports ``loss_fn(model, *batch)``
with ``torch.export``, decomposes it to core ATen, lists every ATen op that the
converter table lacks (all at once, with module paths) and then translates node
by node. Parameters, buffers and lifted constants become graph inputs with
roles; buffer mutations (BatchNorm running statistics) become ``assign``
effects; dropout draws its mask from an ``rng.seed`` state value that advances
every step.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pockengine.frontend import import_memo
from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo
from pockengine.frontend.torch import (  # noqa: F401  (fill the table)
    attention,
    image,
    layout,
    math,
    nn,
    reduce,
    select,
    shape,
)
from pockengine.frontend.torch.converters import CONVERTERS, IGNORED, Ctx, ir_type
from pockengine.ir import (
    CompileError,
    DType,
    GraphBuilder,
    Role,
    UnsupportedOpError,
    Value,
)
from pockengine.ir.arrays import Array

__all__ = ["import_torch", "module_path", "torch_model_info"]

_WRAPPED = "model."


def _require_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise CompileError("the PyTorch frontend needs torch: pip install torch==2.13.0") from exc
    return torch


def module_path(node: Any) -> str:
    """The module path a traced node came from (``encoder.layer.0.attention``), or the loss."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = str(list(stack.values())[-1][0])
        if path.startswith(_WRAPPED):
            return path[len(_WRAPPED) :]
        if path == "model":
            return "<model>"
    return "<loss_fn>"


def _export(model: Any, loss_fn: Callable[..., Any], batch: tuple[Any, ...]) -> Any:
    _require_torch()
    import torch

    class _ModelAndLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return loss_fn(self.model, *args)

    with _torch_internal_warnings_filtered():
        try:
            exported = torch.export.export(_ModelAndLoss(), batch, strict=False)
        except Exception as exc:
            raise CompileError(
                f"torch.export could not trace loss_fn(model, *batch): {type(exc).__name__}: {exc}"
            ) from exc
        table = torch.export.default_decompositions()
        for op in _KEPT_WHOLE:  # ops the IR has whole, rather than their decompositions
            key = getattr(torch.ops.aten, op).default
            if key in table:
                del table[key]
        return exported.run_decompositions(table)


@contextlib.contextmanager
def _torch_internal_warnings_filtered() -> Iterator[None]:
    """Hide the deprecation torch.export's own pytree code raises while copying the
    exported program (``isinstance(treespec, LeafSpec)``): no user can act on it, and it
    appeared in every compile. Scoped to the export; every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning
        )
        yield


# Scaled dot-product attention becomes one IR op (fused kernels, no stored probabilities).
# SDPA's softmax that gives 0, not NaN, on a fully masked row (what the attention
# converter emits with dropout): decomposed, it is four extra passes over the attention
# matrix (eq, not, any, where) and a where in backward. roll: two slices and a concat,
# rather than an index computed with fmod.
_KEPT_WHOLE = ("scaled_dot_product_attention", "_safe_softmax", "roll")


def _check_supported(graph: Any) -> None:
    missing: dict[tuple[str, str], None] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = str(node.target)
        if name not in CONVERTERS and name not in IGNORED:
            missing[(name, module_path(node))] = None
    if missing:
        raise UnsupportedOpError("ATen ops (the PyTorch frontend has no converter)", list(missing))


class _Translator:
    def __init__(self, exported: Any, model: Any, forward_only: bool = False) -> None:
        self.ep = exported
        self.forward_only = forward_only  # an evaluation graph: a small float vector out
        self.model_state = set(model.state_dict().keys())
        self.canonical, self.aliases = _tensor_aliases(model)
        self.b = GraphBuilder("forward")
        self.env: dict[str, Any] = {}
        self.values: dict[str, Array] = {}
        self.state_names: dict[str, str] = {}
        self.batch: list[Value] = []
        self.ctx = Ctx(self.b)

    def _tensor(self, fqn: str) -> Array:
        """The model's own memory, read-only: a backend copies what the step writes and may
        share what it only reads, so compiling holds no second copy of the weights."""
        raw = self.ep.state_dict.get(fqn)
        if raw is None:
            raw = self.ep.constants[fqn]
        array: Array = raw.detach().cpu().numpy()
        array.flags.writeable = False
        return array

    def _input(self, spec: Any, node: Any) -> Value:
        kind = spec.kind.name
        t = ir_type(node.meta["val"])
        if kind == "USER_INPUT":
            value = self.b.input(f"batch.{len(self.batch)}", t, Role.INPUT)
            self.batch.append(value)
            return value
        if kind not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            raise CompileError(f"unsupported exported input {spec.arg.name} of kind {kind}")
        fqn = str(spec.target)
        name = fqn[len(_WRAPPED) :] if fqn.startswith(_WRAPPED) else fqn
        name = self.canonical.get(name, name)  # a tied weight has one name
        if name in self.values:  # ... and one value, however often the export lists it
            return next(v for v in self.b.inputs if v.name == name)
        persistent = name in self.model_state
        if kind == "PARAMETER":
            param = self.ep.state_dict[fqn]
            value = self.b.input(name, t, Role.PARAM, trainable=bool(param.requires_grad))
        elif kind == "BUFFER" and persistent:
            value = self.b.input(name, t, Role.BUFFER)
        else:
            value = self.b.input(name if kind == "BUFFER" else f"const.{name}", t, Role.CONST)
        if t.dtype is DType.BF16 or t.dtype is DType.F16:
            raise CompileError(f"{name} is {t.dtype}: cast the model to float32 first")
        self.values[value.name] = self._tensor(fqn)
        if persistent:
            self.state_names[value.name] = name
        return value

    def run(self) -> ImportedModel:
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs}
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.env[node.name] = self._input(specs[node.name], node)
            elif node.op == "call_function":
                self.env[node.name] = self._call(node)
            elif node.op == "output":
                return self._finish(node)
        raise CompileError("the exported graph has no output")

    def _arg(self, a: Any) -> Any:
        if isinstance(a, list | tuple):
            return [self._arg(x) for x in a]
        if hasattr(a, "op") and hasattr(a, "name") and hasattr(a, "meta"):
            return self.env[a.name]
        return a

    def _call(self, node: Any) -> Any:
        if node.target is operator.getitem:
            return self.env[node.args[0].name][node.args[1]]
        name = str(node.target)
        if name in IGNORED:
            return None
        self.ctx.source = module_path(node)
        self.ctx.out = node.meta.get("val")
        self.ctx.original = str(node.meta.get("original_aten", ""))
        self.ctx.node = node
        args = [self._arg(a) for a in node.args]
        kwargs = {k: self._arg(v) for k, v in node.kwargs.items()}
        try:
            return CONVERTERS[name](self.ctx, *args, **kwargs)
        except CompileError as exc:
            raise CompileError(f"{name} at {self.ctx.source}: {exc}") from exc

    def _finish(self, node: Any) -> ImportedModel:
        outputs = node.args[0]
        losses: list[Value] = []
        for spec, out in zip(self.ep.graph_signature.output_specs, outputs, strict=True):
            value = self.env[out.name] if hasattr(out, "name") else out  # a Python constant
            if spec.kind.name == "BUFFER_MUTATION":
                if self.forward_only:
                    raise CompileError(f"evaluation must not update buffers ({spec.target})")
                fqn = str(spec.target)
                target = self.b.inputs[[v.name for v in self.b.inputs].index(fqn[len(_WRAPPED) :])]
                self.b.effect("assign", target, self.ctx.cast(value, target.dtype), source="buffer")
            elif spec.kind.name == "USER_OUTPUT":
                losses.append(value)
            else:
                raise CompileError(f"unsupported exported output of kind {spec.kind.name}")
        loss = _forward_output(losses) if self.forward_only else _loss_output(losses)
        self.ctx.finish_rng()
        self.values.update(self.ctx.rng.initial_values())
        graph = self.b.build([loss])
        aliases = {n: self.aliases[n] for n in self.state_names.values() if n in self.aliases}
        return ImportedModel(graph, self.values, tuple(self.batch), self.state_names, aliases)


def _loss_output(outputs: list[Any]) -> Value:
    if len(outputs) != 1 or not isinstance(outputs[0], Value):
        got = f"{len(outputs)} outputs" if len(outputs) != 1 else repr(outputs[0])
        raise CompileError(f"loss_fn must return one scalar tensor, got {got}")
    loss = outputs[0]
    if loss.shape != () or not loss.dtype.is_float:
        raise CompileError(f"loss_fn must return a float scalar, got {loss.type}")
    return loss


def _forward_output(outputs: list[Any]) -> Value:
    """An evaluation function's one result: a float scalar or vector (e.g. a loss sum and
    a count of correct predictions, stacked)."""
    if len(outputs) != 1 or not isinstance(outputs[0], Value):
        got = f"{len(outputs)} outputs" if len(outputs) != 1 else repr(outputs[0])
        raise CompileError(f"eval_fn must return one float tensor, got {got}")
    out = outputs[0]
    if out.type.rank > 1 or not out.dtype.is_float:
        raise CompileError(f"eval_fn must return a float scalar or vector, got {out.type}")
    return out


def _tensor_aliases(model: Any) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Tied tensors: every name -> the first name, and first name -> all names."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        head = first.setdefault(id(tensor), name)
        canonical[name] = head
        groups.setdefault(head, []).append(name)
    return canonical, {k: tuple(v) for k, v in groups.items() if len(v) > 1}


def torch_model_info(model: Any) -> ModelInfo:
    """Param names, shapes and owning modules; repeated block containers; the last Linear."""
    torch = _require_torch()
    canonical, _ = _tensor_aliases(model)
    params: list[ParamInfo] = []
    head: str | None = None
    containers: dict[str, tuple[str, ...]] = {}
    repeats: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            name = f"{path}.{local}" if path else local
            if canonical.get(name, name) != name:
                continue  # a tied weight is listed once, under its first name
            kind = type(module).__name__
            params.append(ParamInfo(name, tuple(p.shape), path, kind, bool(p.requires_grad)))
        if isinstance(module, torch.nn.Linear):
            head = path
        if isinstance(module, torch.nn.ModuleList | torch.nn.Sequential) and len(module) >= 2:
            children = list(module.named_children())
            containers[path] = tuple(f"{path}.{c}" if path else c for c, _ in children)
            kinds = Counter(type(c).__name__ for _, c in children)
            size = sum(p.numel() for p in module.parameters())
            repeats[path] = (kinds.most_common(1)[0][1], size)
    blocks = max(repeats, key=lambda k: repeats[k]) if repeats else None
    aliases = {k: v for k, v in canonical.items() if k != v}
    return ModelInfo(tuple(params), containers, head, blocks, aliases)


def import_torch(
    model: Any,
    loss_fn: Callable[..., Any],
    example_batch: Sequence[Any],
    eval_modules: Iterable[str] = (),
    *,
    forward_only: bool = False,
) -> ImportedModel:
    """Translate ``loss_fn(model, *example_batch)`` into a forward graph.

    Modules named in ``eval_modules`` are exported in eval mode (frozen BatchNorm on its
    running statistics); the model's own modes are restored afterwards. ``forward_only``:
    an evaluation graph (``pockengine.step.evaluator``), whose one output may be a small float
    vector rather than a scalar loss, and which must not update buffers.
    """
    torch = _require_torch()
    if not isinstance(model, torch.nn.Module):
        raise CompileError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch = tuple(example_batch)
    bad = [i for i, t in enumerate(batch) if not isinstance(t, torch.Tensor)]
    if bad:
        raise CompileError(f"example_batch entries {bad} are not tensors")
    modules = dict(model.named_modules())
    eval_modules = tuple(eval_modules)
    key = import_memo.key_of(model, loss_fn, batch, eval_modules, forward_only)
    made = import_memo.recall(key)  # the same import made before (``reused_imports``)
    if made is not None:
        return made
    switched = [modules[m] for m in eval_modules if modules[m].training]
    for m in switched:
        m.eval()
    try:
        exported = _export(model, loss_fn, batch)
    finally:
        for m in switched:
            m.train()
    _check_supported(exported.graph)
    imported = _Translator(exported, model, forward_only).run()
    import_memo.remember(key, imported)
    return imported
