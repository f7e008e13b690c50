"""Low-bit frozen weights: the frozen matrices of linear and embedding layers become codes.

``quantize_frozen(graph, values, frozen_dtype)`` runs on the forward graph after the scheme
has resolved (params are marked trainable or frozen), before the forward passes (which then
fuse what reads the dequantized values, e.g. the chunked LM-head loss) and autodiff. Each frozen 2-D
float param that only linear layers (``matmul``/``linear``, through a ``transpose``) and
embeddings read is replaced by its codes, scales (and offsets) as frozen params, and
every reader gets its own ``dequantize`` just before it:

- a matmul's weight: ``dequantize(codes, scales[, offsets])`` -> the float matrix, an
  ordinary intermediate that dies after its reader (``eliminate_common_subexpressions``
  leaves such nodes apart and ``rematerialize`` recomputes them in the backward), so one
  layer's float weight exists at a time;
- an embedding: ``index`` picks the rows of the codes, scales and offsets first and only
  the looked-up rows are dequantized (``[*ids, dim]``, never the whole table).

Trained params are untouched. A weight whose rows are not whole groups stays float.
Weights given in ``prequantized`` (GGUF blocks, keyed by the param's IR name) are used as
they are instead of quantizing the float values; the float values of such a weight may
be absent.

Needs: a verified forward graph with trainable flags set; ``values`` holding every param.
Guarantees: a verified graph computing the same loss with each replaced weight equal to
``dequantize_array`` of its codes; ``QuantizedWeights.params`` says which weights were
replaced and how to read them back as floats (``state_dict``) or write them (``load_state``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.ir import (
    Attrs,
    CompileError,
    DType,
    Graph,
    Node,
    Role,
    SchemeError,
    TensorType,
    Value,
    verify,
)
from pockengine.ir.arrays import Array
from pockengine.ir.rewrite import FreshNames
from pockengine.ops.quant import Quantized, dequantize_array, quantize_int4, quantize_int8

__all__ = [
    "AS_GIVEN",
    "FROZEN_DTYPES",
    "FrozenWeights",
    "QuantizedParam",
    "QuantizedWeights",
    "check_frozen_dtype",
    "quantize_frozen",
]

log = logging.getLogger(__name__)

FROZEN_DTYPES = ("int8", "int4")
INT4_GROUP = 32  # elements per scale and offset; GGUF's Q4_1 block
_READERS = ("matmul", "linear", "transpose")
_SUFFIXES = (".codes", ".scales", ".offsets")


@dataclass(frozen=True, slots=True)
class QuantizedParam:
    """A float param replaced by the graph inputs ``inputs`` (codes, scales[, offsets])."""

    type: TensorType  # the float param's type
    inputs: tuple[str, ...]
    scheme: str
    group: int

    def dequantized(self, read: Callable[[str], Array]) -> Array:
        """The float values the step computes with, from the stored arrays."""
        codes, scales, *offsets = (read(n) for n in self.inputs)
        w = dequantize_array(
            codes, scales, offsets[0] if offsets else None, scheme=self.scheme, group=self.group
        )
        return w.astype(self.type.dtype.to_numpy(), copy=False)

    def quantized(self, array: Array, dtypes: Mapping[str, np.dtype[Any]]) -> dict[str, Array]:
        """The stored arrays for new float values (``load_state``), in the stored dtypes."""
        q = _quantize(np.asarray(array, dtype=np.float32), self.scheme, self.group)
        return {n: a.astype(dtypes[n]) for n, a in zip(self.inputs, q.arrays, strict=True)}


def check_frozen_dtype(frozen_dtype: str | None) -> None:
    if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
        raise CompileError(
            f"frozen_dtype={frozen_dtype!r}: use one of {FROZEN_DTYPES}, or None for float"
        )


@dataclass(frozen=True, slots=True)
class FrozenWeights:
    """How ``compile`` stores frozen weights: ``dtype`` None (as the model has them),
    "int8" or "int4"; ``given``: weights already quantized (GGUF blocks), by model name."""

    dtype: str | None = None
    given: Mapping[str, Quantized] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_frozen_dtype(self.dtype)


AS_GIVEN = FrozenWeights()  # frozen weights as the model has them (the default)


@dataclass(frozen=True, slots=True)
class QuantizedWeights:
    graph: Graph
    values: dict[str, Array]
    params: dict[str, QuantizedParam]


def _quantize(w: Array, scheme: str, group: int) -> Quantized:
    if scheme == "int8":
        return quantize_int8(w, group)
    if scheme == "int4":
        return quantize_int4(w, group)
    raise CompileError(f"weights are not quantized to {scheme!r} at compile time")


def _eligible(v: Value, readers: list[tuple[Node, int]], group: int) -> bool:
    """A frozen float matrix read only as a linear layer's or an embedding's weight."""
    if v.trainable or v.type.rank != 2 or not v.type.dtype.is_float or not readers:
        return False
    if v.shape[-1] % group:
        log.info(
            "%s stays float: rows of %d are not whole groups of %d", v.name, v.shape[-1], group
        )
        return False
    return all(
        (n.op == "embedding" and k == 0) or (n.op in _READERS and (n.op == "transpose" or k == 1))
        for n, k in readers
    )


def _readers(graph: Graph) -> dict[str, list[tuple[Node, int]]]:
    out: dict[str, list[tuple[Node, int]]] = {}
    for node in graph.nodes:
        for k, v in enumerate(node.inputs):
            out.setdefault(v.name, []).append((node, k))
    return out


class _Rewriter:
    """Fresh names, and the dequantize nodes that go before each reader."""

    def __init__(self, graph: Graph, params: dict[str, QuantizedParam]) -> None:
        self.names = FreshNames(graph)
        self.params = params
        self.inputs = {v.name: v for v in graph.inputs}

    def fresh(self, base: str) -> str:
        return self.names.fresh(f"{base}_")

    def result(self, base: str, shape: tuple[int, ...], dtype: DType) -> Value:
        return Value(self.fresh(base.replace(".", "_")), TensorType(shape, dtype))

    def before(self, node: Node) -> tuple[list[Node], Node | None]:
        """The nodes that dequantize what ``node`` reads, and ``node`` reading them (None
        for an embedding: its result is the dequantized rows)."""
        added: list[Node] = []
        inputs = list(node.inputs)
        for k, v in enumerate(node.inputs):
            q = self.params.get(v.name)
            if q is None:
                continue
            ins = tuple(self.inputs[n] for n in q.inputs)
            attrs = Attrs(scheme=q.scheme, group=q.group)
            source = node.source
            if node.op == "embedding":
                ids = node.inputs[1]
                picked = []
                for u in ins:
                    row = self.result(f"{u.name}_rows", (*ids.shape, u.shape[-1]), u.dtype)
                    added.append(Node("index", (u, ids), (row,), Attrs(axes=(0,)), source))
                    picked.append(row)
                out = node.output
                added.append(Node("dequantize", tuple(picked), (out,), attrs, source))
                return added, None
            w = self.result(f"{v.name}_dq", v.shape, v.dtype)
            added.append(Node("dequantize", ins, (w,), attrs, source))
            inputs[k] = w
        return added, node.replace(inputs=tuple(inputs))


def quantize_frozen(
    graph: Graph,
    values: Mapping[str, Array],
    frozen_dtype: str | None,
    *,
    group: int = INT4_GROUP,
    prequantized: Mapping[str, Quantized] | None = None,
) -> QuantizedWeights:
    """Replace the frozen weights of linear and embedding layers by low-bit codes."""
    check_frozen_dtype(frozen_dtype)
    pre = dict(prequantized or {})
    if frozen_dtype is None and not pre:
        return QuantizedWeights(graph, dict(values), {})
    readers = _readers(graph)
    new_values = dict(values)
    params: dict[str, QuantizedParam] = {}
    new_inputs: list[Value] = []
    for v in graph.inputs:
        q = _weight(v, readers.get(v.name, []), values, frozen_dtype, group, pre)
        if q is None:
            new_inputs.append(v)
            continue
        names = tuple(v.name + s for s in _SUFFIXES[: len(q.arrays)])
        for name, array in zip(names, q.arrays, strict=True):
            new_inputs.append(
                Value(
                    name,
                    TensorType(array.shape, DType.from_numpy(array.dtype)),
                    Role.PARAM,
                    trainable=False,
                )
            )
            new_values[name] = array
        new_values.pop(v.name, None)
        params[v.name] = QuantizedParam(v.type, names, q.scheme, q.group)
    rewrite = _Rewriter(graph.replace(inputs=tuple(new_inputs)), params)
    nodes: list[Node] = []
    for node in graph.nodes:
        added, rewritten = rewrite.before(node)
        nodes.extend(added)
        if rewritten is not None:
            nodes.append(rewritten)
    out = graph.replace(inputs=tuple(new_inputs), nodes=tuple(nodes))
    return QuantizedWeights(verify(out), new_values, params)


def _weight(
    v: Value,
    readers: list[tuple[Node, int]],
    values: Mapping[str, Array],
    frozen_dtype: str | None,
    group: int,
    pre: Mapping[str, Quantized],
) -> Quantized | None:
    """The quantized form of graph input ``v``, or None where it stays as it is."""
    if v.role is not Role.PARAM:
        return None
    if v.name in pre and not (v.trainable and v.name in values):
        if v.trainable:  # trained, and there is nothing else to train
            raise SchemeError(
                f"the scheme trains {v.name}, which is stored quantized (frozen): leave it out"
            )
        return pre[v.name]
    if frozen_dtype is None or not _eligible(v, readers, 1 if frozen_dtype == "int8" else group):
        return None
    w = values[v.name]
    return quantize_int8(w) if frozen_dtype == "int8" else quantize_int4(w, group)
