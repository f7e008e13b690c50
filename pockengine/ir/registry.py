"""The op registry: one OpDef per op, registered where the op is defined.

The registry lives here, in the ground floor; the op families in
``pockengine.ops`` register into it when imported. An OpDef holds everything
the engine knows about an op: its shape/dtype rule, its NumPy reference
kernel, its vector-Jacobian product written in IR ops, its FLOPs, the inputs it
writes in place (effectful ops), its facts (``Fact``) and sample inputs for the op table
tests.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from enum import Flag, auto
from typing import Any, Protocol, TypeVar

import numpy as np

from pockengine.ir.arrays import Array
from pockengine.ir.errors import ShapeError, UnsupportedOpError
from pockengine.ir.types import Attrs, DType, Node, Phase, TensorType, Value

__all__ = [
    "COMMUTATIVE",
    "EFFECTFUL",
    "ELEMENTWISE",
    "GRAD_PREFIX",
    "Fact",
    "NodeSink",
    "OpDef",
    "Sample",
    "VJPContext",
    "all_ops",
    "defop",
    "get_op",
    "grad_source",
    "has_op",
    "register",
    "registrar",
]


class Fact(Flag):
    """What the engine may assume about an op, declared once on its ``@defop``.

    Passes, the memory plan and backends ask these instead of listing op names, so a new
    op is described in one place. ``tests/test_op_facts.py`` checks the claims that a
    backend's kernels can contradict (views alias, in-place kernels honour ``out=``).
    """

    ELEMENTWISE = auto()  # output shape = broadcast of inputs, one result per element
    COMMUTATIVE = auto()  # op(a, b) == op(b, a)
    SHAPE = auto()  # moves or views data, computes nothing
    REDUCTION = auto()  # reduces over axes
    SCAN = auto()  # a running reduction along an axis (cumsum)
    CREATION = auto()  # makes a tensor from its attributes alone (full, arange, random_mask)
    CONSTANT = auto()  # its result is a compile-time constant, never written (full, arange)
    VIEW = auto()  # a backend may return its first input itself or a view of it
    INPLACE = auto()  # its result may overwrite a dying input of equal shape and dtype
    CHEAP = auto()  # cheap enough to recompute in the backward pass (rematerialisation)
    NO_GRADIENT = auto()  # no cotangent crosses it (stop_gradient)
    SAME_TYPE_IDENTITY = auto()  # returns its first input when the result has its type
    EFFECTFUL = auto()  # writes some inputs in place; set by ``defop`` from ``mutates``


NO_FACTS = Fact(0)
ELEMENTWISE = Fact.ELEMENTWISE
EFFECTFUL = Fact.EFFECTFUL
COMMUTATIVE = Fact.COMMUTATIVE


@dataclass(frozen=True, slots=True)
class Sample:
    """Inputs (float64 where differentiable) and attributes for op table tests."""

    inputs: tuple[Array, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


class NodeSink(Protocol):
    """Where a VJP rule's nodes go: the ``GraphBuilder`` (``ir.builder``, which looks ops up
    in this registry), named here by the calls ``VJPContext`` makes."""

    def call(
        self,
        op: str,
        *inputs: Value,
        source: str = "",
        name: str | None = None,
        phase: Phase | None = None,
        **attrs: Any,
    ) -> Value: ...

    def call_multi(
        self,
        op: str,
        *inputs: Value,
        source: str = "",
        name: str | None = None,
        phase: Phase | None = None,
        **attrs: Any,
    ) -> tuple[Value, ...]: ...

    def scalar(
        self, value: float, dtype: DType = DType.F32, source: str = "", phase: Phase | None = None
    ) -> Value: ...


@dataclass(slots=True)
class VJPContext:
    """What a VJP rule sees: the forward node, its output cotangents, which inputs need one."""

    b: NodeSink
    node: Node
    cts: tuple[Value | None, ...]
    needs: tuple[bool, ...]

    @property
    def attrs(self) -> Attrs:
        return self.node.attrs

    @property
    def inputs(self) -> tuple[Value, ...]:
        return self.node.inputs

    @property
    def out(self) -> Value:
        return self.node.output

    @property
    def ct(self) -> Value:
        """The cotangent of the only output (zeros are never passed; see autodiff)."""
        ct = self.cts[0]
        if ct is None:
            raise ValueError(f"{self.node.op}: no cotangent for its output")
        return ct

    @property
    def source(self) -> str:
        """Backward nodes carry the forward node's source behind GRAD_PREFIX (for the
        report's per-layer attribution; their phase, not this text, marks them)."""
        return grad_source(self.node.source)

    def call(self, op: str, *inputs: Value, **attrs: Any) -> Value:
        return self.b.call(op, *inputs, source=self.source, phase=Phase.BACKWARD, **attrs)

    def call_multi(self, op: str, *inputs: Value, **attrs: Any) -> tuple[Value, ...]:
        return self.b.call_multi(op, *inputs, source=self.source, phase=Phase.BACKWARD, **attrs)

    def const(self, value: float, like: Value) -> Value:
        return self.b.scalar(value, like.dtype, source=self.source, phase=Phase.BACKWARD)


GRAD_PREFIX = "grad "


def grad_source(source: str) -> str:
    """The source of a backward node: the forward node's source with GRAD_PREFIX."""
    return GRAD_PREFIX + (source or "?")


InferFn = Callable[..., TensorType | tuple[TensorType, ...]]
KernelFn = Callable[..., Any]
VJPFn = Callable[[VJPContext], Sequence[Value | None]]
FlopsFn = Callable[[tuple[TensorType, ...], tuple[TensorType, ...], Attrs], int]
SamplesFn = Callable[[np.random.Generator], list[Sample]]


def _elementwise_flops(
    ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], attrs: Attrs
) -> int:
    return sum(t.numel for t in outs)


@dataclass(frozen=True, slots=True)
class OpDef:
    """Everything about one op.

    ``infer(*input_types, **attrs)`` returns the output type(s) or raises ShapeError.
    ``kernel(*arrays, **attrs)`` returns the output array(s); an effectful op returns
    the new values of the inputs listed in ``mutates``, in that order.
    ``vjp(ctx)`` emits the backward ops and returns one cotangent (or None) per input.
    """

    name: str
    infer: InferFn
    kernel: KernelFn
    vjp: VJPFn | None = None
    flops: FlopsFn = _elementwise_flops
    mutates: tuple[int, ...] = ()
    facts: Fact = NO_FACTS
    samples: SamplesFn | None = None
    doc: str = ""

    @property
    def effectful(self) -> bool:
        return bool(self.mutates)

    def has(self, fact: Fact) -> bool:
        """Whether the op has every fact in ``fact``."""
        return fact in self.facts

    def infer_types(self, types: Sequence[TensorType], attrs: Attrs) -> tuple[TensorType, ...]:
        try:
            out = self.infer(*types, **attrs)
        except (ShapeError, TypeError, ValueError, IndexError, KeyError) as exc:
            shown = ", ".join(str(t) for t in types)
            raise ShapeError(f"{self.name}({shown}; {dict(attrs)}): {exc}") from exc
        return out if isinstance(out, tuple) else (out,)

    def run(self, arrays: Sequence[Array], attrs: Attrs) -> tuple[Array, ...]:
        out = self.kernel(*arrays, **attrs)
        return tuple(out) if isinstance(out, tuple | list) else (out,)


_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add one op to the registry; each name is registered once."""
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name!r} is registered twice")
    _REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        if not _REGISTRY:
            raise UnsupportedOpError(
                "ops (the registry is empty: import pockengine.ops)", [(name, "")]
            ) from None
        raise UnsupportedOpError("IR ops", [(name, "")]) from None


def has_op(name: str) -> bool:
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def defop(
    name: str, *, facts: Fact = NO_FACTS, mutates: tuple[int, ...] = ()
) -> Callable[[type], OpDef]:
    """Class decorator: the class body holds the op's rules as static methods.

    ``infer`` and ``kernel`` are required; ``vjp``, ``flops`` and ``samples`` are
    optional. The class docstring states the math and becomes the op's doc. ``facts``
    are what passes may assume (``Fact``); ``mutates`` lists the inputs an effect writes.
    """

    def wrap(cls: type) -> OpDef:
        ns = vars(cls)
        missing = [k for k in ("infer", "kernel") if k not in ns]
        if missing:
            raise TypeError(f"op {name!r} lacks {missing}")
        opdef = OpDef(
            name=name,
            infer=ns["infer"].__func__,
            kernel=ns["kernel"].__func__,
            vjp=ns["vjp"].__func__ if "vjp" in ns else None,
            flops=ns["flops"].__func__ if "flops" in ns else _elementwise_flops,
            mutates=mutates,
            facts=facts | (Fact.EFFECTFUL if mutates else NO_FACTS),
            samples=ns["samples"].__func__ if "samples" in ns else None,
            doc=(cls.__doc__ or "").strip(),
        )
        return register(opdef)

    return wrap


_F = TypeVar("_F", bound=Callable[..., Any])


def registrar(table: MutableMapping[str, Any]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator factory: ``@register("a", "b")`` puts the function in ``table`` under
    each of the names (frontends' converters by ATen overload, ONNX or TF op type or jaxpr
    primitive; backends' kernels by IR op)."""

    def register(*names: str) -> Callable[[_F], _F]:
        def wrap(fn: _F) -> _F:
            for name in names:
                table[name] = fn
            return fn

        return wrap

    return register
