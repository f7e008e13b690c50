"""JAX frontend: ``jax.make_jaxpr`` of the loss, a flat converter table keyed by primitive.

``import_jax(params, loss_fn, example_batch)`` traces ``loss_fn(params, *batch)`` with
``jax.make_jaxpr``, lists every primitive the converter table lacks (all at once, with
the user's source lines), then translates equation by equation, inlining ``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``closed_call`` and ``checkpoint`` (the engine
differentiates the inlined primal; a custom rule is not used, except for functions that
are one IR op, such as ``jax.nn.relu``). Flax ``nn.BatchNorm`` calls in training mode are
lowered whole to the ``batch_norm`` op (``flax``).

``params`` is any pytree: a Flax linen variables dict (``{'params': ..., 'batch_stats':
...}``), a Flax nnx ``State``, an Equinox module, a plain dict (see ``info`` for how
leaves are named and which ones train). ``loss_fn`` returns the scalar loss, or
``(loss, updates)`` where ``updates`` is a pytree of new values for buffers, keyed by the
same paths as ``params``: what ``model.apply(variables, x, mutable=['batch_stats'])``
returns as its second result. Each updated buffer is written with an ``assign`` effect
after the step, as the torch frontend stores BatchNorm running statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from pockengine.frontend.imported import ImportedModel, ModelInfo
from pockengine.frontend.jax import math, nn, shape  # noqa: F401  (fill the table)
from pockengine.frontend.jax.check import FOLD_LIMIT, check_supported, module_of
from pockengine.frontend.jax.converters import (
    CONVERTERS,
    INLINED,
    JCtx,
    inner_jaxpr,
    ir_dtype,
    ir_type,
    named_call,
)
from pockengine.frontend.jax.flax import whole_flax_modules
from pockengine.frontend.jax.info import Leaves, flatten_params, key_names, model_info
from pockengine.ir import CompileError, GraphBuilder, Role, TensorType, Value
from pockengine.ir.arrays import Array

__all__ = ["import_jax", "jax_model_info"]

_log = logging.getLogger(__name__)


def _require_jax() -> Any:
    try:
        import jax
    except ImportError as exc:
        raise CompileError('the JAX frontend needs jax: pip install "pockengine[jax]"') from exc
    return jax


def jax_model_info(params: Any) -> ModelInfo:
    """Param names, shapes and modules of a params pytree; repeated blocks; the head."""
    return model_info(flatten_params(_require_jax(), params))


def _trace(
    jax: Any, leaves: Leaves, loss_fn: Callable[..., Any], batch: Sequence[Array]
) -> tuple[Any, Any]:
    """(closed jaxpr, output shape pytree) of ``loss_fn(params, *batch)``, with Flax
    BatchNorms lowered whole (``flax``); traced again primitive by primitive when that
    fails (a loss_fn that differentiates or vmaps the model itself)."""

    def traced(arrays: list[Any], *items: Any) -> Any:
        return loss_fn(leaves.rebuild(arrays), *items)

    make = jax.make_jaxpr(traced, return_shape=True)
    arrays = [leaf.value for leaf in leaves.arrays]
    lowering = None
    try:
        with whole_flax_modules() as lowering:
            result: tuple[Any, Any] = make(arrays, *batch)
        return result
    except Exception as exc:
        if lowering is None or not lowering.modules:
            raise _trace_error(exc) from exc
        _log.info("traced again without whole Flax modules (%s): %s", lowering.modules, exc)
    try:
        result = make(arrays, *batch)
    except Exception as exc:
        raise _trace_error(exc) from exc
    return result


def _trace_error(exc: Exception) -> CompileError:
    return CompileError(
        f"jax.make_jaxpr could not trace loss_fn(params, *batch): {type(exc).__name__}: {exc}"
    )


class _Translator:
    def __init__(self, jax: Any, leaves: Leaves) -> None:
        self.jax = jax
        self.leaves = leaves
        self.b = GraphBuilder("forward")
        self.cx = JCtx(self.b)
        self.values: dict[str, Array] = {}
        self.consts = 0

    # -- inputs ------------------------------------------------------------------------
    def inputs(self, closed: Any, batch: Sequence[Array]) -> tuple[list[Value], list[Value]]:
        """Graph inputs for the jaxpr's invars (params and buffers, then the batch, cast
        to what JAX traced) and consts; returns (the jaxpr's operands, the batch inputs)."""
        operands: list[Value] = []
        invars = closed.jaxpr.invars
        for leaf, var in zip(self.leaves.arrays, invars, strict=False):
            t = ir_type(var.aval)
            value = self.b.input(leaf.ir, t, leaf.role, trainable=leaf.role is Role.PARAM)
            self.values[leaf.ir] = np.asarray(leaf.value, dtype=t.dtype.to_numpy())
            operands.append(value)
        batch_inputs: list[Value] = []
        for i, (item, var) in enumerate(zip(batch, invars[len(operands) :], strict=True)):
            given = TensorType(tuple(item.shape), ir_dtype(item.dtype))
            value = self.b.input(f"batch.{i}", given, Role.INPUT)
            batch_inputs.append(value)
            operands.append(self.cx.cast(value, ir_type(var.aval).dtype))
        return operands, batch_inputs

    def const(self, array: Any) -> Value:
        value = np.asarray(array)
        v = self.b.input(
            f"const.{self.consts}", TensorType(value.shape, ir_dtype(value.dtype)), Role.CONST
        )
        self.consts += 1
        self.values[v.name] = value
        if value.size <= FOLD_LIMIT:
            self.cx.known[v.name] = value
        return v

    def literal(self, lit: Any) -> Value:
        value = np.asarray(lit.val, dtype=lit.aval.dtype)
        t = ir_type(lit.aval)
        if value.ndim:
            return self.const(value)
        v = self.cx.full(value.item(), t.dtype, t.shape)
        self.cx.known[v.name] = value
        return v

    # -- equations -------------------------------------------------------------------
    def run(
        self, jaxpr: Any, consts: Sequence[Any], operands: list[Value], prefix: str
    ) -> list[Value]:
        """Translate ``jaxpr`` applied to ``operands``; returns its outputs."""
        env: dict[Any, Value] = {}
        for var, const in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.const(const)
        env.update(zip(jaxpr.invars, operands, strict=True))
        for eqn in jaxpr.eqns:
            ins = [self.literal(v) if _is_literal(v) else env[v] for v in eqn.invars]
            outs = self.equation(eqn, ins, module_of(eqn, prefix))
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [self.literal(v) if _is_literal(v) else env[v] for v in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[Value], path: str) -> list[Value]:
        name = eqn.primitive.name
        source = path or "<loss_fn>"
        op = named_call(eqn)
        if op is not None:
            return [self.b.call(op, *ins, source=source)]
        if name in INLINED:
            inner, consts = inner_jaxpr(eqn)
            return self.run(inner, consts, ins[len(ins) - len(inner.invars) :], path)
        if name == "scan":
            return self._scan(eqn, ins, path)
        keys = any(self._is_key(v.aval.dtype) for v in eqn.outvars)
        if name not in CONVERTERS or keys:  # from constants alone (check.foldable)
            return self._fold(eqn, ins, source)
        cx = self.cx
        cx.source, cx.params = source, dict(eqn.params)
        cx.out_types = tuple(ir_type(v.aval) for v in eqn.outvars)
        try:
            result = CONVERTERS[name](cx, *ins)
        except CompileError as exc:
            raise CompileError(f"{name} at {source}: {exc}") from exc
        outs = list(result) if isinstance(result, list | tuple) else [result]
        for value, want in zip(outs, cx.out_types, strict=True):
            if value.type != want:
                raise CompileError(f"{name} at {source}: converted to {value.type}, JAX has {want}")
        self._propagate_known(eqn, ins, outs)
        return outs

    def _scan(self, eqn: Any, ins: list[Value], path: str) -> list[Value]:
        """``lax.scan`` (Flax's ``nn.RNN``, ``nn.scan``) unrolled over its static length:
        the body once per step on that step's slices, the carry threaded through, the
        per-step outputs stacked. Autodiff then backpropagates through the steps."""
        p = eqn.params
        body, n_const, n_carry = p["jaxpr"], int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = (
            ins[:n_const],
            ins[n_const : n_const + n_carry],
            ins[n_const + n_carry :],
        )
        steps = range(int(p["length"]))
        ys: dict[int, list[Value]] = {}
        for t in reversed(steps) if p["reverse"] else steps:
            x_t = [
                self.cx.call(
                    "reshape",
                    self.cx.call("slice", x, axis=0, start=t, stop=t + 1, step=1),
                    shape=x.shape[1:],
                )
                for x in xs
            ]
            outs = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_t], path)
            carry, ys[t] = outs[:n_carry], outs[n_carry:]
        stacked = []
        for k, var in enumerate(eqn.outvars[n_carry:]):
            parts = [self.cx.call("reshape", ys[t][k], shape=(1, *ys[t][k].shape)) for t in steps]
            joined = parts[0] if len(parts) == 1 else self.cx.call("concat", *parts, axis=0)
            stacked.append(self.cx.cast(joined, ir_type(var.aval).dtype))
        return [*carry, *stacked]

    def _fold(self, eqn: Any, ins: list[Value], source: str) -> list[Value]:
        """An equation without a converter, on constants: JAX evaluates it now, and its
        results become constants of the graph."""
        known = self.cx.known
        name = eqn.primitive.name
        if not all(v.name in known for v in ins):
            raise CompileError(
                f"{name} at {source}: no converter, and its operands are computed at run time"
            )
        results = eqn.primitive.bind(*(known[v.name] for v in ins), **eqn.params)
        results = results if eqn.primitive.multiple_results else [results]
        outs = []
        for var, result in zip(eqn.outvars, results, strict=True):
            if self._is_key(var.aval.dtype):
                outs.append(self._key(result))  # e.g. the rngs Flax splits per scan step
                continue
            value = np.asarray(result, dtype=var.aval.dtype)
            if value.ndim:
                outs.append(self.const(value))
            else:
                out = self.cx.full(value.item(), ir_type(var.aval).dtype)
                known[out.name] = value
                outs.append(out)
        return outs

    def _is_key(self, dtype: Any) -> bool:
        return bool(self.jax.dtypes.issubdtype(dtype, self.jax.dtypes.prng_key))

    def _key(self, key: Any) -> Value:
        """A PRNG key made from constants: its raw data as an int64 constant stands in for
        it in the graph (nothing converted reads keys), the key itself stays known so that
        later folds (``random_split``) can use it."""
        value = self.const(np.asarray(self.jax.random.key_data(key), dtype=np.int64))
        self.cx.known[value.name] = key
        return value

    def _propagate_known(self, eqn: Any, ins: list[Value], outs: list[Value]) -> None:
        """Evaluate small equations on static operands with JAX itself, so that slice
        starts computed from constants are known when compiling."""
        known = self.cx.known
        if not all(v.name in known for v in ins) or any(v.type.numel > FOLD_LIMIT for v in outs):
            return
        try:
            results = eqn.primitive.bind(*(known[v.name] for v in ins), **eqn.params)
        except Exception:  # a primitive JAX cannot evaluate eagerly stays unknown
            return
        results = results if eqn.primitive.multiple_results else [results]
        for value, result in zip(outs, results, strict=True):
            known[value.name] = np.asarray(result)


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _updates(jax: Any, out_shape: Any) -> list[str]:
    """Model names of the buffer updates that follow the loss among the outputs."""
    if not isinstance(out_shape, tuple | list):
        return []
    if len(out_shape) != 2:
        raise CompileError("loss_fn must return the loss, or (loss, updated buffers pytree)")
    flat, _ = jax.tree_util.tree_flatten_with_path(out_shape[1])
    return ["/".join(key_names(path)) for path, _ in flat]


def _write_back(tr: _Translator, leaves: Leaves, names: list[str], values: list[Value]) -> None:
    by_key = {leaf.key: leaf for leaf in leaves.arrays}
    inputs = {v.name: v for v in tr.b.inputs}
    unknown = [n for n in names if n not in by_key]
    if unknown:
        raise CompileError(f"loss_fn returned updates for {unknown}, which are not in params")
    for name, new in zip(names, values, strict=True):
        target = inputs[by_key[name].ir]
        if new is target:
            continue  # returned unchanged
        if target.role is Role.PARAM:
            raise CompileError(f"loss_fn returned a new value for the parameter {name}")
        tr.b.effect("assign", target, tr.cx.cast(new, target.dtype), source="buffer")


def _batch_arrays(example_batch: Sequence[Any]) -> list[Array]:
    out = []
    for i, item in enumerate(example_batch):
        if not (hasattr(item, "shape") and hasattr(item, "dtype")):
            raise CompileError(f"example_batch entry {i} is not an array")
        out.append(np.asarray(item))
    return out


def import_jax(
    params: Any,
    loss_fn: Callable[..., Any],
    example_batch: Sequence[Any],
    eval_modules: Iterable[str] = (),
) -> ImportedModel:
    """Translate ``loss_fn(params, *example_batch)`` into a forward graph."""
    jax = _require_jax()
    if list(eval_modules):
        raise CompileError(
            "frozen_bn='eval' cannot switch a JAX model's BatchNorms to running statistics; "
            "pass use_running_average=True in loss_fn instead"
        )
    leaves = flatten_params(jax, params)
    batch = _batch_arrays(example_batch)
    closed, out_shape = _trace(jax, leaves, loss_fn, batch)
    check_supported(jax, closed)
    tr = _Translator(jax, leaves)
    operands, batch_inputs = tr.inputs(closed, batch)
    outs = tr.run(closed.jaxpr, closed.consts, operands, "")
    loss = outs[0]
    if loss.shape != () or not loss.dtype.is_float:
        raise CompileError(f"loss_fn must return a float scalar first, got {loss.type}")
    _write_back(tr, leaves, _updates(jax, out_shape), outs[1:])
    state_names = {leaf.ir: leaf.key for leaf in leaves.arrays}

    def restructure(flat: dict[str, Array]) -> Any:
        return leaves.rebuild([flat[leaf.key] for leaf in leaves.arrays])

    graph = tr.b.build([loss])
    return ImportedModel(graph, tr.values, tuple(batch_inputs), state_names, {}, restructure)
