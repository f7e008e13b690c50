"""What every frontend returns: a forward graph plus the values of its non-batch inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.ir import Graph, Value
from pockengine.ir.arrays import Array

__all__ = ["ImportedModel", "ModelInfo", "ParamInfo"]


@dataclass
class ImportedModel:
    """A forward graph whose first output is the scalar loss.

    ``values`` holds the initial value of every param, buffer, const and state
    input, keyed by IR name. ``batch`` lists the batch inputs in call order.
    ``state_names`` maps the IR names of params and persistent buffers to the
    model's own names (``model.state_dict()`` keys, or pytree paths); ``aliases`` lists
    every name of a tied tensor (an LM head sharing the embedding) under its first name.
    ``restructure``, when set, turns the flat ``{model name: array}`` state back into the
    model's own structure (a JAX pytree); ``TrainStep.state_dict()`` returns that.
    """

    graph: Graph
    values: dict[str, Array]
    batch: tuple[Value, ...]
    state_names: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    restructure: Callable[[dict[str, Array]], Any] | None = None


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as a scheme sees it (frontend-neutral)."""

    name: str  # the model's own name; also the IR value name
    shape: tuple[int, ...]
    module: str  # path of the owning module ("" at the top)
    module_type: str  # the owning module's class name ("" if the frontend has none)
    requires_grad: bool = True
    channel_axis: int = 0  # the output-channel axis (JAX kernels: the last one)

    @property
    def local(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def is_norm(self) -> bool:
        return "norm" in self.module_type.lower() or self.module_type in ("BatchNorm", "LayerNorm")

    @property
    def is_bias(self) -> bool:
        return self.local == "bias"

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class ModelInfo:
    """What schemes resolve against: params in order, repeated block containers, the head."""

    params: tuple[ParamInfo, ...]
    containers: dict[str, tuple[str, ...]]  # container path -> child module paths, in order
    head: str | None  # module path of the last linear layer
    blocks: str | None = None  # the container of repeated blocks (most repeats of one class)
    canonical: dict[str, str] = field(default_factory=dict)  # tied alias -> listed name

    def param(self, name: str) -> ParamInfo:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)
