"""Keras layers lowered whole, and the ModelInfo of a Keras model.

Three layer classes are not translated op by op from their TF expansion but from the layer
itself (``trace`` puts an Identity marker where their call was):

- ``BatchNormalization``: in training mode (and ``layer.trainable``, as Keras decides) the
  ``batch_norm`` op on batch statistics, and ``assign`` effects that update the moving
  statistics as Keras does, ``moving = moving * momentum + batch * (1 - momentum)`` with the
  biased batch variance; in inference mode, or for a layer in ``eval_modules`` (a scheme's
  ``frozen_bn="eval"``), elementwise ops on the moving statistics;
- ``LayerNormalization``: the ``layer_norm`` op over the trailing axes it normalises;
- ``Dropout``: ``rng.dropout`` (a ``random_mask`` and a bool keep-mask), as the other
  frontends lower it.

Their TF expansions hold ``StopGradient`` (in ``tf.nn.moments``), seed-generator state and
moving-average assignments, and the single IR ops cost the same FLOPs as the PyTorch
frontend's lowering.

Names: a Keras variable's path ("block_1/dense/kernel") becomes the IR name with dots
("block_1.dense.kernel"), the module is the path of the layer that owns the variable
("block_1.dense") and the module type its class ("Dense"). The Keras paths are aliases of
the IR names, so scheme patterns may use either form.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from pockengine.frontend.imported import ModelInfo, ParamInfo
from pockengine.frontend.lowering import batch_norm_eval
from pockengine.frontend.operands import Ctx, sanitize
from pockengine.ir import CompileError, GraphBuilder, Role, Value

__all__ = ["LAYER_CONVERTERS", "KerasCtx", "ir_name", "keras_info", "layer_module"]

LayerConverter = Callable[["KerasCtx", Any, Value, bool], Value]
LAYER_CONVERTERS: dict[str, LayerConverter] = {}


def ir_name(path: str) -> str:
    """The IR name of a Keras variable path: "/" becomes "."."""
    return sanitize(path.replace("/", "."))


def layer_module(layer: Any) -> str:
    return ir_name(str(getattr(layer, "path", None) or layer.name))


class KerasCtx(Ctx):
    """The converters' context plus the IR value of each Keras variable (made on first use)."""

    def __init__(self, b: GraphBuilder, variable: Callable[[Any], Value]) -> None:
        super().__init__(b)
        self.variable = variable

    def weight(self, v: Any | None, like: Value, shape: tuple[int, ...], fill: float) -> Value:
        """A layer's optional weight, or a constant ``fill`` when the layer has none."""
        if v is None:
            return self.full(fill, like.dtype, shape)
        return self.cast(self.variable(v), like.dtype)


def _layer_converter(name: str) -> Callable[[LayerConverter], LayerConverter]:
    def wrap(fn: LayerConverter) -> LayerConverter:
        LAYER_CONVERTERS[name] = fn
        return fn

    return wrap


def _channels_to_1(x: Value, axis: int) -> tuple[int, ...]:
    """The permutation that brings ``axis`` to position 1 (and, applied again inverted, back)."""
    order = [d for d in range(x.type.rank) if d != axis]
    return (order[0], axis, *order[1:])


@_layer_converter("BatchNormalization")
def _batch_norm(cx: KerasCtx, layer: Any, x: Value, training: bool) -> Value:
    axis = layer.axis % x.type.rank
    perm = _channels_to_1(x, axis)
    moved = perm != tuple(range(x.type.rank))
    xc = cx.call("transpose", x, perm=perm) if moved else x
    shape = (x.shape[axis],)
    w = cx.weight(layer.gamma if layer.scale else None, x, shape, 1.0)
    b = cx.weight(layer.beta if layer.center else None, x, shape, 0.0)
    mean, var = cx.variable(layer.moving_mean), cx.variable(layer.moving_variance)
    if getattr(layer, "renorm", False):
        raise CompileError(f"BatchNormalization {layer.path}: renorm is not supported")
    if training and layer.trainable and layer_module(layer) not in cx.eval_modules:
        y, batch_mean, batch_var = cx.call_multi("batch_norm", xc, w, b, eps=float(layer.epsilon))
        keep, take = cx.full(float(layer.momentum), x.dtype), cx.full(1 - layer.momentum, x.dtype)
        for moving, batch in ((mean, batch_mean), (var, batch_var)):
            blended = cx.call("add", cx.call("mul", moving, keep), cx.call("mul", batch, take))
            cx.effect("assign", moving, cx.cast(blended, moving.dtype))
    else:
        mean, var = cx.cast(mean, x.dtype), cx.cast(var, x.dtype)
        y = batch_norm_eval(cx.b, cx.source, xc, w, b, mean, var, float(layer.epsilon))
    inverse = tuple(perm.index(d) for d in range(x.type.rank))
    return cx.call("transpose", y, perm=inverse) if moved else y


@_layer_converter("LayerNormalization")
def _layer_norm(cx: KerasCtx, layer: Any, x: Value, training: bool) -> Value:
    rank = x.type.rank
    axes = sorted(
        {a % rank for a in (layer.axis if isinstance(layer.axis, list | tuple) else [layer.axis])}
    )
    if axes != list(range(rank - len(axes), rank)) or getattr(layer, "rms_scaling", False):
        raise CompileError(
            f"LayerNormalization {layer.path}: only trailing axes without rms_scaling, "
            f"got axis={layer.axis}"
        )
    shape = x.shape[rank - len(axes) :]
    w = cx.weight(layer.gamma if layer.scale else None, x, shape, 1.0)
    b = cx.weight(layer.beta if layer.center else None, x, shape, 0.0)
    w, b = (v if v.shape == shape else cx.call("reshape", v, shape=shape) for v in (w, b))
    y, _, _ = cx.call_multi("layer_norm", x, w, b, eps=float(layer.epsilon), ndim=len(axes))
    return y


@_layer_converter("Dropout")
def _dropout(cx: KerasCtx, layer: Any, x: Value, training: bool) -> Value:
    if getattr(layer, "noise_shape", None) is not None:
        raise CompileError(f"Dropout {layer.path}: noise_shape is not supported")
    if not training or layer.rate == 0:
        return x
    return cx.dropout(x, float(layer.rate))[0]


# -- ModelInfo -------------------------------------------------------------------------------


def own_variables(layer: Any) -> tuple[list[Any], list[Any]]:
    """The variables a layer holds itself: (trainable kind, non-trainable kind)."""
    return list(layer._trainable_variables), list(layer._non_trainable_variables)


def _children(layer: Any) -> list[Any]:
    return [c for c in layer._flatten_layers(include_self=False, recursive=False) if c.weights]


def _size(layer: Any) -> int:
    return sum(int(np.prod(v.shape, dtype=np.int64)) for v in layer.weights)


def _containers(model: Any) -> tuple[dict[str, tuple[str, ...]], str | None]:
    """For each layer, its children (holding weights) of its most repeated class, when there
    are two or more; the blocks: the container whose repeated children hold most weights."""
    containers: dict[str, tuple[str, ...]] = {}
    rank: dict[str, tuple[int, int]] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        groups: dict[str, list[Any]] = defaultdict(list)
        for child in _children(layer):
            groups[type(child).__name__].append(child)
        best = max(groups.values(), key=lambda g: (len(g), sum(map(_size, g))), default=[])
        if len(best) >= 2:
            path = "" if layer is model else layer_module(layer)
            containers[path] = tuple(layer_module(c) for c in best)
            rank[path] = (sum(map(_size, best)), len(best))
    return containers, max(rank, key=lambda k: rank[k]) if rank else None


def _channel_axis(local: str, shape: tuple[int, ...]) -> int:
    """Keras kernels keep output channels last ([in, out], HWIO); tables keep rows first."""
    return len(shape) - 1 if len(shape) >= 2 and local != "embeddings" else 0


def owners(model: Any) -> dict[int, Any]:
    """id(variable) -> the layer that holds it."""
    return {
        id(v): layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        for kind in own_variables(layer)
        for v in kind
    }


def keras_info(model: Any) -> ModelInfo:
    """Params in ``model.weights`` order, their owning layers, repeated blocks, the last Dense
    (the head)."""
    params: list[ParamInfo] = []
    aliases: dict[str, str] = {}
    head: str | None = None
    owner = owners(model)
    for v in model.weights:
        if variable_role(owner, v) is not Role.PARAM:
            continue
        kind, name = type(owner[id(v)]).__name__, ir_name(v.path)
        module, _, local = name.rpartition(".")
        shape = tuple(int(d) for d in v.shape)
        params.append(
            ParamInfo(name, shape, module, kind, bool(v.trainable), _channel_axis(local, shape))
        )
        aliases.update({str(v.path): name} if v.path != name else {})
        head = module if kind == "Dense" else head
    containers, blocks = _containers(model)
    return ModelInfo(tuple(params), containers, head, blocks, aliases)


def variable_role(layer_of: dict[int, Any], v: Any) -> Role:
    """PARAM for a layer's trainable-kind variable, BUFFER for the rest (moving stats)."""
    owner = layer_of.get(id(v))
    trainable = own_variables(owner)[0] if owner is not None else []
    return Role.PARAM if any(t is v for t in trainable) else Role.BUFFER
