"""Flax linen modules lowered whole: ``nn.BatchNorm`` in training mode becomes one primitive.

Traced primitive by primitive, Flax's BatchNorm is a dozen elementwise ops and reductions
(``E[x^2] - E[x]^2``, ``rsqrt``, ...), which cost other FLOPs, forward and backward, than
the single ``batch_norm`` op the PyTorch and Keras frontends emit. So while the frontend
traces ``loss_fn``, ``whole_flax_modules()`` installs a Flax method interceptor
(``nn.intercept_methods``, Flax's public hook, the way ``keras.trace`` wraps layer calls):
a call of ``nn.BatchNorm`` (or a subclass that keeps its ``__call__``) that computes batch
statistics binds ``pockengine_batch_norm``, a JAX primitive whose results are the
normalised ``y`` and the batch mean and biased variance, exactly the IR ``batch_norm`` op.
The running statistics are then updated in ``jnp`` with Flax's own expression,
``ra = momentum * ra + (1 - momentum) * batch_stat``, and written back with
``put_variable`` as Flax does, so ``model.apply(..., mutable=["batch_stats"])`` returns
them and ``jax.py`` stores them with ``assign`` effects.

Flax's variance is ``max(0, E[x^2] - E[x]^2)`` (``use_fast_variance``) or
``E[(x - E[x])^2]``; both are the biased variance the op computes, up to rounding.

The call is left to Flax (and traced primitive by primitive) when it is not that plain
case: running averages (``use_running_average=True``; elementwise ops on the statistics,
as the other frontends' eval mode), initialisation, a ``mask``, an ``axis_name``, more
than one feature axis, dtypes other than one float32 or float64 for ``x``, the params,
the statistics and the result, or an immutable ``batch_stats`` collection (where Flax
raises its own error). The primitive has no JVP or batching rule: a ``loss_fn`` that
differentiates or vmaps the model itself fails to trace with it, and ``jax.py`` then
traces again without the interceptor.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from pockengine.frontend.jax.converters import JCtx, primitive
from pockengine.ir import Value

__all__ = ["BATCH_NORM", "Lowering", "whole_flax_modules"]

BATCH_NORM = "pockengine_batch_norm"
_FLOATS = ("float32", "float64")


class Lowering:
    """What one trace lowered whole: the module paths, in call order."""

    def __init__(self) -> None:
        self.modules: list[str] = []


@contextlib.contextmanager
def whole_flax_modules() -> Iterator[Lowering]:
    """While active, Flax BatchNorm calls in training mode bind ``pockengine_batch_norm``.

    Does nothing when ``flax.linen`` was never imported: then no linen module exists.
    """
    lowering = Lowering()
    nn = sys.modules.get("flax.linen")
    if nn is None:
        yield lowering
        return

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name == "__call__" and type(module).__call__ is nn.BatchNorm.__call__:
            operands = _batch_norm_operands(module, args, kwargs)
            if operands is not None:
                lowering.modules.append("/".join(str(p) for p in module.path))
                return _batch_norm(module, *operands)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield lowering


def _batch_norm_operands(module: Any, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """(x, scale, bias, running mean, running var, feature axis) of an intercepted
    ``BatchNorm.__call__(x, use_running_average, mask=...)`` to lower whole, or None to
    leave the call to Flax (nothing is written then)."""
    import jax.numpy as jnp
    from flax.linen.module import merge_param

    x = args[0]
    given = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
    try:
        use_running_average = merge_param("use_running_average", module.use_running_average, given)
    except Exception:  # both or neither given: Flax's call raises its own error
        return None
    if use_running_average or kwargs.get("mask") is not None or len(args) > 2:
        return None
    axis = _feature_axis(module, x)
    if axis is None or module.is_initializing() or module.axis_name is not None:
        return None
    if not module.is_mutable_collection("batch_stats"):
        return None
    stats = [_variable(module, "batch_stats", n) for n in ("mean", "var")]
    affine = [
        _variable(module, "params", n) if use else jnp.full(x.shape[axis], fill, x.dtype)
        for n, use, fill in (("scale", module.use_scale, 1.0), ("bias", module.use_bias, 0.0))
    ]
    operands = (*affine, *stats)
    if any(v is None for v in operands):
        return None
    if {np.dtype(v.dtype) for v in operands} != {np.dtype(x.dtype)}:
        return None
    if module.dtype is not None and np.dtype(module.dtype) != np.dtype(x.dtype):
        return None
    if any(tuple(v.shape) != (x.shape[axis],) for v in operands):
        return None
    return (x, *operands, axis)


def _batch_norm(module: Any, x: Any, scale: Any, bias: Any, mean: Any, var: Any, axis: int) -> Any:
    """Bind the primitive and update the running statistics as Flax does."""
    y, batch_mean, batch_var = _primitive().bind(
        x, scale, bias, axis=axis, epsilon=float(module.epsilon)
    )
    m = module.momentum
    module.put_variable("batch_stats", "mean", m * mean + (1 - m) * batch_mean)
    module.put_variable("batch_stats", "var", m * var + (1 - m) * batch_var)
    return y


def _feature_axis(module: Any, x: Any) -> int | None:
    """The one feature axis of a float32/float64 ``x`` of rank >= 2, else None."""
    axes = module.axis if isinstance(module.axis, tuple | list) else (module.axis,)
    if len(axes) != 1 or x.ndim < 2 or np.dtype(x.dtype).name not in _FLOATS:
        return None
    return int(axes[0]) % int(x.ndim)


def _variable(module: Any, collection: str, name: str) -> Any:
    return module.get_variable(collection, name) if module.has_variable(collection, name) else None


@functools.cache
def _primitive() -> Any:
    """``pockengine_batch_norm(x, scale, bias; axis, epsilon) -> (y, mean, var)``: made
    once, on first use (jax is imported only by the frontend). It exists to be traced: it
    has an abstract evaluation and no implementation, JVP or batching rule."""
    try:
        from jax.extend.core import Primitive
    except ImportError:  # pragma: no cover - older JAX keeps it in jax.core only
        from jax.core import Primitive  # type: ignore[attr-defined,no-redef]

    prim = Primitive(BATCH_NORM)
    prim.multiple_results = True

    def abstract(x: Any, scale: Any, bias: Any, *, axis: int, epsilon: float) -> list[Any]:
        stat = x.update(shape=(x.shape[axis],), weak_type=False)
        return [x, stat, stat]

    prim.def_abstract_eval(abstract)  # type: ignore[no-untyped-call]
    return prim


@primitive(BATCH_NORM)
def _convert_batch_norm(cx: JCtx, x: Value, scale: Value, bias: Value) -> tuple[Value, ...]:
    """The ``batch_norm`` op over ``axis`` (moved to position 1 and back, as Keras's
    channels-last BatchNormalization is): y, batch mean, biased batch variance."""
    axis = int(cx.params["axis"])
    order = [d for d in range(x.type.rank) if d != axis]
    perm = (order[0], axis, *order[1:])
    xc = cx.transpose(x, perm)
    y, mean, var = cx.call_multi("batch_norm", xc, scale, bias, eps=float(cx.params["epsilon"]))
    return cx.transpose(y, tuple(perm.index(d) for d in range(x.type.rank))), mean, var
