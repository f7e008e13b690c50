"""The backend interface.

A backend turns a graph into an ``Executable`` and converts arrays to and from its
own tensors. The state of a training step (params, buffers, optimizer state, the
dropout seed) lives in a ``Store``: a dict of backend tensors keyed by IR name,
shared by every executable of one ``TrainStep`` and written by the effectful
nodes. An op a backend lacks is a compile-time ``UnsupportedOpError`` naming
every such op and where it came from.

A backend also says which nodes it can run (``claims``: by default, those whose op is in
its kernel table, ``supported_ops``) and which values are its own tensors (``holds``), so
that a list of backends (``backends.mixed``) can split a graph between them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from pockengine.ir import Graph, Node, UnsupportedOpError, all_ops
from pockengine.ir.arrays import Array

__all__ = ["Backend", "Executable", "NotShareableError", "Store", "check_ops"]

Store = MutableMapping[str, Any]


class NotShareableError(Exception):
    """``Backend.share_written`` cannot train that array in place; the message says why."""


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

    def under_budget(self, budget: int) -> Backend:
        """This backend for a step whose planned peak is capped at ``budget`` bytes
        (``pe.compile(..., memory_budget=...)``). A backend that adds memory the training
        graph's plan does not hold (the C backend's layout conversions and kernels' working
        memory) returns a copy that gives those up to fit; the default is itself."""
        return self

    @abstractmethod
    def from_numpy(self, array: Array) -> Any:
        """A copy of ``array`` that the backend owns (it never aliases ``array``)."""

    def share_numpy(self, array: Array) -> Any:
        """``array`` for a value the step only ever reads (a frozen weight, a constant): a
        backend that can run on the caller's memory shares it instead of copying, so
        compiling holds no second copy of the frozen weights. Default: ``from_numpy``."""
        return self.from_numpy(array)

    def share_written(self, array: Array) -> Any:
        """``array``'s own memory as a value the step writes in place (a trained param of
        the caller's model, ``pe.compile(..., in_place=True)``): the step's updates land in
        ``array``. ``array`` is C-contiguous, writable and of the graph's dtype. A backend
        that cannot raises ``NotShareableError`` saying why (default: it keeps its own
        copy of what it writes)."""
        raise NotShareableError(f"the {self.name} backend keeps its own copy of what it writes")

    def feed(self, array: Array) -> Any:
        """``array`` as one step's batch input, read during that call only. Default:
        ``from_numpy``; a backend that copies its inputs into its own memory when it runs
        (the C arena) takes the caller's array as it is, so a step makes no extra copy."""
        return self.from_numpy(array)

    @abstractmethod
    def to_numpy(self, tensor: Any) -> Array: ...

    def supported_ops(self) -> frozenset[str]:
        """The ops of its kernel table. The default, every registered op, suits a backend
        that checks its graph itself when it compiles (and fails there)."""
        return frozenset(all_ops())

    def claims(self, node: Node) -> bool:
        """Whether this backend can run ``node`` (default: its op has a kernel here)."""
        return node.op in self.supported_ops()

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one of this backend's own tensors (no hand-over needed)."""
        return False


def check_ops(graph: Graph, supported: Iterable[str], backend: str) -> None:
    """Raise one UnsupportedOpError listing every op of ``graph`` the backend lacks."""
    known = set(supported)
    missing = {(n.op, n.source): None for n in graph.nodes if n.op not in known}
    if missing:
        raise UnsupportedOpError(f"ops for the {backend} backend", list(missing))
