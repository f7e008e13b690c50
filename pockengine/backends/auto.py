"""``backend="auto"``: each node on the backend whose kernel is fastest for its shapes.

This is the paper's backend switching, measured rather than guessed. At compile time each
pure node is timed on every candidate backend (torch and ONNX Runtime on the CPU by
default): the node alone as a one-node graph, on random inputs of its types, a few runs
after a warm-up, the median kept. Timings are cached per (op, input types, attributes)
for the process, so a model's repeated blocks are timed once. Effects (optimizer updates,
buffer statistics) are not timed: they stay on the primary backend (the first), which holds
the params, so the forward reads them without a hand-over every step.

The choice is then a shortest path over the node sequence (one state per backend): a node
costs its measured time, and switching backends between two nodes costs a fixed
per-segment overhead plus the bytes of the values the node reads from earlier nodes at a
measured hand-over rate. So a kernel that wins by less than what the boundary costs stays
with its neighbours. Timing stops after ``budget_s`` seconds; nodes not timed by then go to
the first backend that claims them. The time spent is logged.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pockengine.backends.base import Backend
from pockengine.backends.mixed import MixedBackend, hand_over
from pockengine.ir import (
    DType,
    Graph,
    Node,
    PockEngineError,
    Role,
    TensorType,
    Value,
    get_op,
)
from pockengine.ir.arrays import Array
from pockengine.plan.placement import PRIMARY

__all__ = ["AutoBackend", "node_timings"]

log = logging.getLogger(__name__)
_INF = float("inf")
# (backend name, op, input types, attrs) -> median seconds (inf: the backend cannot run it)
_TIMINGS: dict[tuple[Any, ...], float] = {}


def _random_input(t: Any, rng: np.random.Generator) -> Array:
    """Normal floats; zeros for integer and bool inputs (valid indices and targets)."""
    if t.dtype.is_float:
        dtype = np.float32 if t.dtype is DType.BF16 else t.dtype.to_numpy()
        return np.asarray(rng.standard_normal(t.shape), dtype=dtype)
    return np.zeros(t.shape, dtype=t.dtype.to_numpy())


def _time_node(node: Node, backend: Backend, repeats: int) -> float:
    """The median time of ``node`` alone on ``backend`` (inf when it cannot run it)."""
    xs = tuple(Value(f"time_in{i}_", v.type, Role.INPUT) for i, v in enumerate(node.inputs))
    alone = Graph(f"time_{node.op}", xs, (node.replace(inputs=xs),), node.outputs)
    rng = np.random.default_rng(0)
    try:
        executable = backend.compile(alone)
        feeds = {x.name: backend.from_numpy(_random_input(x.type, rng)) for x in xs}
        executable.run({}, feeds)  # warm-up (and the check that it runs at all)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            executable.run({}, feeds)
            times.append(time.perf_counter() - start)
    except (PockEngineError, RuntimeError, ValueError, TypeError, IndexError):
        return _INF
    return statistics.median(times)


_SCALAR_NODE = Node(
    "neg", (Value("x", TensorType((), DType.F32)),), (Value("y", TensorType((), DType.F32)),)
)


def node_timings(
    graph: Graph, backends: Sequence[Backend], repeats: int = 5, budget_s: float = 60.0
) -> list[list[float]]:
    """Seconds per node per backend: inf where the backend does not claim the node or its
    kernel failed, nan where it was not timed: out of budget, or an effect (its params stay
    with the first backend claiming it, the primary, so that the forward reads them without
    a hand-over). Cached per (backend, op, input types, attributes)."""
    start = time.perf_counter()
    timed = 0
    out = []
    # a call's own overhead (binding, dispatch) is paid once per segment, not per node
    empty = {b.name: _time_node(_SCALAR_NODE, b, repeats) for b in backends}
    for node in graph.nodes:
        row = []
        for backend in backends:
            if not backend.claims(node):
                row.append(_INF)
                continue
            if get_op(node.op).effectful:
                row.append(float("nan"))
                continue
            where = (backend.name, str(getattr(backend, "device", "")))
            key = (*where, node.op, tuple(v.type for v in node.inputs), node.attrs)
            if key not in _TIMINGS:
                if time.perf_counter() - start > budget_s:
                    row.append(float("nan"))
                    continue
                _TIMINGS[key] = max(_time_node(node, backend, repeats) - empty[backend.name], 0.0)
                timed += 1
            row.append(_TIMINGS.get(key, float("nan")))
        out.append(row)
    log.info("auto: timed %d kernels in %.1f s", timed, time.perf_counter() - start)
    return out


def _hand_over_cost(backends: Sequence[Backend]) -> tuple[float, float]:
    """(seconds per boundary, seconds per byte) of handing a 1 MiB array between the first
    two backends and back."""
    array = np.zeros(1 << 18, dtype=np.float32)
    a, b = backends[0], backends[1]
    times = []
    for size in (1, array.size):
        y = a.from_numpy(array[:size])
        start = time.perf_counter()
        for _ in range(5):
            hand_over(hand_over(y, backends, b), backends, a)
        times.append((time.perf_counter() - start) / 10)
    per_byte = max(times[1] - times[0], 0.0) / array.nbytes
    return times[0], per_byte


class AutoBackend(MixedBackend):
    """Per node, the fastest of ``backends`` (default: torch and ONNX Runtime on the CPU)."""

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        repeats: int = 5,
        budget_s: float = 60.0,
        segment_overhead_s: float = 50e-6,
    ) -> None:
        if backends is None:
            from pockengine.backends.onnx.backend import OrtBackend
            from pockengine.backends.torch.backend import TorchBackend

            backends = [TorchBackend(), OrtBackend(device="cpu")]
        super().__init__(backends)
        self.name = "auto"
        self.repeats = repeats
        self.budget_s = budget_s
        self.segment_overhead_s = segment_overhead_s  # one more executable call per segment
        self._rates: tuple[float, float] | None = None

    def assign(self, graph: Graph) -> tuple[int, ...]:
        first = super().assign(graph)  # raises for a node nobody claims
        times = node_timings(graph, self.backends, self.repeats, self.budget_s)
        if self._rates is None:
            self._rates = _hand_over_cost(self.backends)
        fixed, per_byte = self._rates
        return _cheapest_path(graph, times, first, self.segment_overhead_s + fixed, per_byte)


def _cheapest_path(
    graph: Graph, times: list[list[float]], first: Sequence[int], switch_s: float, per_byte: float
) -> tuple[int, ...]:
    """The assignment minimising node times plus switching costs (a Viterbi pass). An
    untimed node costs nothing on the backend that claims it first and is barred elsewhere.
    The step starts on the primary (which holds the batch): starting elsewhere is a switch."""
    n_backends = len(times[0]) if times else 0
    made = {v.name for node in graph.nodes for v in node.outputs}
    cost = [0.0 if k == PRIMARY else switch_s for k in range(n_backends)]
    back: list[list[int]] = []
    for i, node in enumerate(graph.nodes):
        row = [
            t if not np.isnan(t) else (0.0 if k == first[i] else _INF)
            for k, t in enumerate(times[i])
        ]
        crossing = sum(v.type.nbytes for v in node.inputs if v.name in made)
        switch = switch_s + crossing * per_byte
        new, choice = [], []
        for k in range(n_backends):
            j = min(range(n_backends), key=lambda j: cost[j] + (switch if j != k else 0.0))
            new.append(cost[j] + (switch if j != k else 0.0) + row[k])
            choice.append(j)
        cost = new
        back.append(choice)
    if not back:
        return ()
    k = min(range(n_backends), key=lambda k: cost[k])
    path = [k]
    for choice in reversed(back[1:]):
        k = choice[k]
        path.append(k)
    return tuple(reversed(path))
