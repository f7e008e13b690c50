"""What every frontend returns: a forward graph plus the values of its non-batch inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.ir import Graph, Value

__all__ = ["ImportedModel"]

Array = np.ndarray[Any, Any]


@dataclass
class ImportedModel:
    """A forward graph whose first output is the scalar loss.

    ``values`` holds the initial value of every param, buffer, const and state
    input, keyed by IR name. ``batch`` lists the batch inputs in call order.
    ``state_names`` maps the IR names of params and persistent buffers to the
    model's own names (``model.state_dict()`` keys, or pytree paths); ``aliases`` lists
    every name of a tied tensor (an LM head sharing the embedding) under its first name.
    """

    graph: Graph
    values: dict[str, Array]
    batch: tuple[Value, ...]
    state_names: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
