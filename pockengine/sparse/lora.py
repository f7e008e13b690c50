"""LoRA as a scheme: low-rank adapters inserted into the forward graph at compile time.

``schemes.lora(rank, alpha, targets)`` resolves, against the model's ``ModelInfo``, to one
``Adapter`` per targeted linear weight W (frozen) and two new trained params, named as
PEFT names them (without its ``base_model.model.`` prefix): ``<module>.lora_A.weight``
``[rank, in]`` and ``<module>.lora_B.weight`` ``[out, rank]``. ``insert_adapters`` then
rewrites the imported forward graph: every matmul that reads W (as ``transpose(W)``, the
torch layout, or W itself, the JAX/ONNX ``[in, out]`` layout) gets

    y = x W^T (+ b) + (alpha / rank) * (x A^T) B^T

added after its bias. A starts uniform in ``+-1/sqrt(in)`` (PEFT's ``kaiming_uniform_(a=
sqrt(5))``, seeded), B at zero, so the compiled step starts from the model's own function.
The adapters are ordinary trained params: autodiff, sparse backward pruning (W gets no
gradient and no optimizer state) and the optimizer treat them like any other.

Needs before: an imported forward graph, a resolution with ``adapters``. Guarantees after:
the same graph with each targeted linear output replaced by its adapted value, and the
adapter params (with their initial values and model names) added to the imported model.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo
from pockengine.ir import (
    CompileError,
    Graph,
    GraphBuilder,
    Node,
    Role,
    SchemeError,
    TensorType,
    Value,
)
from pockengine.ir.arrays import Array
from pockengine.ir.rewrite import substitute
from pockengine.sparse.resolution import Adapter, Resolution

__all__ = ["DEFAULT_TARGETS", "Adapter", "insert_adapters", "merge_adapters", "resolve_lora"]


# The attention query and value projections, by the module names model families give them:
# LLaMA/Mistral/Qwen/OPT/SmolLM, BERT/RoBERTa/MiniLM, DistilBERT, T5, DeBERTa-v2, and the
# fused query-key-value projection of BLOOM, GPT-NeoX and Falcon. ``targets=None`` takes the
# first set the model has (PEFT's defaults for these families are the same modules).
DEFAULT_TARGETS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "v_proj"),
    ("query", "value"),
    ("q_lin", "v_lin"),
    ("q", "v"),
    ("query_proj", "value_proj"),
    ("query_key_value",),
)


def resolve_lora(
    info: ModelInfo,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> Resolution:
    """The adapters of ``targets`` (module globs, or PEFT-style module names that match as a
    whole path component suffix) and their trained factors."""
    if not isinstance(rank, int) or rank < 1:
        raise SchemeError(f"lora rank must be a whole number >= 1, got {rank!r}")
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise SchemeError(f"lora alpha must be a number > 0, got {alpha!r}")
    if dropout != 0:
        # TODO(#17): a random_mask on the adapter input, seeded like the frontends' dropout
        raise SchemeError(f"lora dropout {dropout} is not supported yet; use dropout=0.0")
    adapters = tuple(
        Adapter(p.module, p.name, *_in_out(p), rank, float(alpha), seed, p.channel_axis % 2 == 1)
        for p in _targeted(info, targets)
    )
    rows: dict[str, int | None] = {}
    for a in adapters:
        rows.update({a.a_name: None, a.b_name: None})
    return Resolution(rows, adapters=adapters)


def _in_out(p: ParamInfo) -> tuple[int, int]:
    """(in, out) of a linear weight: torch ``[out, in]``, JAX/ONNX kernels ``[in, out]``."""
    out_axis = p.channel_axis % 2
    return p.shape[1 - out_axis], p.shape[out_axis]


def _linear_weights(info: ModelInfo) -> list[ParamInfo]:
    return [
        p
        for p in info.params
        if len(p.shape) == 2
        and p.local in ("weight", "kernel")
        and not p.is_norm
        and "embed" not in p.module_type.lower()
    ]


def _targeted(info: ModelInfo, targets: Sequence[str] | None) -> list[ParamInfo]:
    weights = _linear_weights(info)
    patterns = list(targets) if targets is not None else _default_targets(weights)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = [p.name for p in weights if _module_matches(p.module, pattern)]
        if not hits:
            modules = [p.module for p in weights]
            near = difflib.get_close_matches(pattern, modules, n=5, cutoff=0.2)
            raise SchemeError(
                f"lora target {pattern!r} matches no linear layer; nearest: {near or modules[:5]}"
            )
        chosen.update(hits)
    return [p for p in weights if p.name in chosen]


def _default_targets(weights: list[ParamInfo]) -> list[str]:
    leaves = {p.module.rsplit(".", 1)[-1] for p in weights}
    for pair in DEFAULT_TARGETS:
        if set(pair) <= leaves:
            return list(pair)
    known = ", ".join("/".join(pair) for pair in DEFAULT_TARGETS)
    raise SchemeError(
        f"the model has none of the attention projections LoRA targets by default ({known}); "
        f"name them: schemes.lora(targets=[...]); its linear layers end in {sorted(leaves)[:8]}"
    )


def _module_matches(module: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern)


def merge_adapters(state: dict[str, Array], adapters: Sequence[Adapter]) -> dict[str, Array]:
    """``state`` (model names) with each adapter folded into its weight, W + scale * B A
    (transposed for an ``[in, out]`` kernel), and the factors dropped: the plain model's
    weights that compute what the adapted step computes."""
    out = dict(state)
    for a in adapters:
        delta = a.scale * (out.pop(a.b_name) @ out.pop(a.a_name))
        weight = out[a.weight]
        out[a.weight] = (weight + (delta.T if a.kernel else delta)).astype(weight.dtype)
    return out


# -- the graph rewrite -------------------------------------------------------------------


@dataclass(frozen=True)
class _Site:
    adapter: Adapter
    x: Value  # the linear layer's input


def insert_adapters(imported: ImportedModel, adapters: Sequence[Adapter]) -> ImportedModel:
    """``imported`` with every matmul reading an adapted weight rewritten to add its
    low-rank term, and the adapter params with their initial values."""
    if not adapters:
        return imported
    graph = imported.graph
    sites = _sites(graph, adapters)
    b = GraphBuilder.rewriting(graph)
    factors: dict[str, tuple[Value, Value]] = {}
    values = dict(imported.values)
    for index, a in enumerate(adapters):
        dtype = graph.input_named(a.weight).dtype
        lo = b.input(a.a_name, TensorType((a.rank, a.in_features), dtype), Role.PARAM)
        up = b.input(a.b_name, TensorType((a.out_features, a.rank), dtype), Role.PARAM)
        factors[a.weight] = (lo, up)
        bound = 1.0 / math.sqrt(a.in_features)
        np_dtype = dtype.to_numpy()
        rng = np.random.default_rng((a.seed, index))
        values[lo.name] = rng.uniform(-bound, bound, (a.rank, a.in_features)).astype(np_dtype)
        values[up.name] = np.zeros((a.out_features, a.rank), dtype=np_dtype)
    mapping: dict[str, Value] = {}
    for node in graph.nodes:
        (node,) = substitute([node], mapping)
        b.append(node)
        for out in node.outputs:
            if out.name in sites:
                site = sites[out.name]
                mapping[out.name] = _adapted(b, site, out, *factors[site.adapter.weight])
    outputs = [mapping.get(v.name, v) for v in graph.outputs]
    names = {**imported.state_names, **{n: n for pair in factors.values() for n in
                                        (pair[0].name, pair[1].name)}}  # fmt: skip
    return replace(imported, graph=b.build(outputs), values=values, state_names=names)


def _adapted(b: GraphBuilder, site: _Site, z: Value, lo: Value, up: Value) -> Value:
    """``z + scale * (x lo^T) up^T``, one node a line."""
    src = f"{site.adapter.module}.lora"
    lo_t = b.call("transpose", lo, perm=(1, 0), source=src)
    down = b.call("matmul", site.x, lo_t, source=src)
    up_t = b.call("transpose", up, perm=(1, 0), source=src)
    delta = b.call("matmul", down, up_t, source=src)
    scaled = b.call("mul", delta, b.scalar(site.adapter.scale, z.dtype, source=src), source=src)
    return b.call("add", z, scaled, source=src)


def _sites(graph: Graph, adapters: Sequence[Adapter]) -> dict[str, _Site]:
    """Where each adapter's term joins: keyed by the value it is added to."""
    by_weight = {a.weight: a for a in adapters}
    producers = graph.producers()
    users = graph.users()
    sites: dict[str, _Site] = {}
    found: set[str] = set()
    for node in graph.nodes:
        weight = _matmul_weight(node, producers) if node.op == "matmul" else None
        if weight is None or weight not in by_weight:
            continue
        a = by_weight[weight]
        if node.inputs[1].shape != (a.in_features, a.out_features):
            raise CompileError(
                f"lora: {weight} reaches a matmul as {node.inputs[1].type}, not as the "
                f"[{a.in_features}, {a.out_features}] (in, out) operand of a linear layer"
            )
        sites[_bias_add(node, users) or node.output.name] = _Site(a, node.inputs[0])
        found.add(weight)
    missing = sorted(set(by_weight) - found)
    if missing:
        raise CompileError(f"lora: {missing} are not the weight of a matmul in the traced graph")
    return sites


def _matmul_weight(node: Node, producers: dict[str, Node]) -> str | None:
    """The param a matmul's right operand is, directly or as ``transpose(W, (1, 0))``."""
    y = node.inputs[1]
    if y.role is Role.PARAM:
        return y.name
    made = producers.get(y.name)
    if made is not None and made.op == "transpose" and made.attrs.get("perm") == (1, 0):
        w = made.inputs[0]
        return w.name if w.role is Role.PARAM else None
    return None


def _bias_add(node: Node, users: dict[str, list[Node]]) -> str | None:
    """The ``add(z, bias)`` that is the matmul's only reader, if any: the adapter term joins
    after it, so ``fuse_linear_bias`` still fuses the layer's matmul and bias."""
    readers = users.get(node.output.name, [])
    if len(readers) != 1 or readers[0].op != "add":
        return None
    add = readers[0]
    others = [v for v in add.inputs if v.name != node.output.name]
    if len(others) == 1 and others[0].role is Role.PARAM and others[0].type.rank == 1:
        return add.output.name
    return None
