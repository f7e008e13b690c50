"""The backend interface.

A backend turns a graph into an ``Executable`` and converts arrays to and from its
own tensors. The state of a training step (params, buffers, optimizer state, the
dropout seed) lives in a ``Store``: a dict of backend tensors keyed by IR name,
shared by every executable of one ``TrainStep`` and written by the effectful
nodes. An op a backend lacks is a compile-time ``UnsupportedOpError`` naming
every such op and where it came from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np

from pockengine.ir import Graph, UnsupportedOpError

__all__ = ["Backend", "Executable", "Store", "check_ops"]

Array = np.ndarray[Any, Any]
Store = MutableMapping[str, Any]


class Executable(ABC):
    """One compiled graph. ``run`` executes it once."""

    graph: Graph

    @abstractmethod
    def run(self, store: Store, feeds: Mapping[str, Any]) -> list[Any]:
        """Run with params/state from ``store`` (updated in place) and batch ``feeds``."""


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(self, graph: Graph) -> Executable: ...

    @abstractmethod
    def from_numpy(self, array: Array) -> Any:
        """A copy of ``array`` that the backend owns (it never aliases ``array``)."""

    @abstractmethod
    def to_numpy(self, tensor: Any) -> Array: ...


def check_ops(graph: Graph, supported: Iterable[str], backend: str) -> None:
    """Raise one UnsupportedOpError listing every op of ``graph`` the backend lacks."""
    known = set(supported)
    missing = {(n.op, n.source): None for n in graph.nodes if n.op not in known}
    if missing:
        raise UnsupportedOpError(f"ops for the {backend} backend", list(missing))
