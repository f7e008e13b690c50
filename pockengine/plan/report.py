"""The compile-time report: what a training graph costs, beside full backprop.

``analyze(graph)`` reads the facts off a compiled training graph: trained
elements, forward and backward FLOPs, saved-activation bytes (forward values and
batch inputs that a backward node reads), parameter, gradient and optimizer-state
bytes, the planned peak of the static memory plan, and the same per layer (module
path, cut to ``depth`` components). ``Report`` puts a scheme's figures beside
those of full backprop and renders them as text or a dict; for a step on several
backends it also shows the placement (nodes per backend, boundary transfers).
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pockengine.ir import GRAD_PREFIX, Graph, Node, Phase, Role, Value, get_op
from pockengine.plan.cost import cost
from pockengine.plan.liveness import Liveness
from pockengine.plan.memory import MemoryPlan, plan_memory
from pockengine.plan.placement import Placement

if TYPE_CHECKING:
    from pockengine.plan.recomputation import Recomputation

__all__ = ["BackendMemory", "Figures", "KernelChoice", "LayerFigures", "Report", "analyze"]

_UPDATE_GRAD_INPUT = 1  # sgd_update, sgd_momentum_update, adamw_update: (w, g, ...)


@dataclass(frozen=True)
class KernelChoice:
    """A node's kernel as the backend chose it by measurement at compile time
    (``CBackend(tune=True)``): the median seconds of each candidate it timed, and for a
    node whose kernel is a GEMM, the micro-kernel shape chosen the same way."""

    op: str
    output: str  # the node's first output, which names it in the IR listing
    kernel: str
    seconds: dict[str, float]
    cached: bool  # read from the backend's table of earlier measurements
    shape: str = ""  # the GEMM's micro-kernel shape ("12x32"); "" where none was timed
    shape_seconds: dict[str, float] = field(default_factory=dict)  # each shape's median

    @property
    def time(self) -> float:
        if self.shape:
            return self.shape_seconds.get(self.shape, float("nan"))
        return self.seconds.get(self.kernel, float("nan"))

    def line(self) -> str:
        """The node, its kernel (and shape) and time, then the other candidates' times (ms)."""
        others = [f"{k} {v * 1e3:.3f}" for k, v in self.seconds.items() if k != self.kernel]
        others += [f"{k} {v * 1e3:.3f}" for k, v in self.shape_seconds.items() if k != self.shape]
        kernel = f"{self.kernel} {self.shape}" if self.shape else self.kernel
        text = f"{self.op:<20}{self.output:<28}{kernel:<11}{self.time * 1e3:>10.3f} ms"
        if others:
            text += f"  others: {', '.join(others)}"
        return text + ("  (cached)" if self.cached else "")


@dataclass(frozen=True)
class BackendMemory:
    """The memory plan of the step as its backend runs it, where the backend plans its own
    (the C backend's arena): after the backend's layout pass and with its kernels' working
    memory, which the training graph's plan (the report's "planned peak") does not hold.
    ``given_up``: what a memory budget made the backend give up, one line each."""

    backend: str
    planned_peak_bytes: int  # its arena and the persistent values (params, state)
    arena_bytes: int
    work_bytes: int  # kernels' working memory, summed over the nodes that take it
    work_nodes: int
    conversion_bytes: int  # layout conversions' results, summed
    conversions: int
    budget: int | None = None  # pe.compile(memory_budget=...), bytes
    given_up: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        out = [
            f"{self.backend} step's own plan: planned peak {_mib(self.planned_peak_bytes)} "
            f"(arena {_mib(self.arena_bytes)})"
            + ("" if self.budget is None else f", budget {_mib(self.budget)}"),
            f"  kernels' working memory: {_mib(self.work_bytes)} on {self.work_nodes} nodes; "
            f"layout conversions: {_mib(self.conversion_bytes)} in {self.conversions}",
        ]
        if self.given_up:
            out.append("  given up to meet the budget:")
            out += [f"    {line}" for line in self.given_up]
        return out


@dataclass
class LayerFigures:
    trained_elements: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0


@dataclass
class Figures:
    trained_elements: int
    forward_flops: int
    backward_flops: int
    update_flops: int
    saved_activation_bytes: int
    param_bytes: int
    gradient_bytes: int  # every trained param's gradient, summed
    # the most gradient bytes alive at once: each gradient dies at its update, which
    # ``reorder_updates`` moves into the backward pass, so this is one layer's, not the sum
    gradient_live_bytes: int
    optimizer_state_bytes: int
    planned_peak_bytes: int
    layers: dict[str, LayerFigures] = field(default_factory=dict)
    # frozen params by dtype: float weights, low-bit codes and their scales (docs/quant.md)
    frozen_bytes: dict[str, int] = field(default_factory=dict)


def _layer(node: Node, depth: int | None) -> str:
    """The layer a node is attributed to: its source, less the marks that autodiff and the
    optimizer put before the forward node's or the param's name."""
    source = node.source
    if node.phase is Phase.BACKWARD and source.startswith(GRAD_PREFIX):
        source = source[len(GRAD_PREFIX) :]
    if source.startswith("optim "):
        source = source[len("optim ") :].rsplit(".", 1)[0]
    if depth is None or source.startswith("<"):
        return source
    return ".".join(source.split(".")[:depth])


def analyze(graph: Graph, depth: int | None = None) -> Figures:
    """The figures of one training (or gradients) graph."""
    costs = cost(graph)
    layers: dict[str, LayerFigures] = {}
    forward_made: dict[str, str] = {v.name: "<batch>" for v in graph.inputs if v.role is Role.INPUT}
    saved: dict[str, int] = {}
    trained = 0
    gradients: list[Value] = []
    for node, c in zip(graph.nodes, costs.nodes, strict=True):
        row = layers.setdefault(_layer(node, depth), LayerFigures())
        if c.phase is Phase.FORWARD:
            row.forward_flops += c.flops
            for v in node.outputs:
                forward_made[v.name] = _layer(node, depth)
        elif c.phase is Phase.BACKWARD:
            row.backward_flops += c.flops
            for v in node.inputs:
                if v.name in forward_made and v.name not in saved:
                    saved[v.name] = v.type.nbytes
                    owner = layers.setdefault(forward_made[v.name], LayerFigures())
                    owner.saved_bytes += v.type.nbytes
        elif node.op != "assign" and get_op(node.op).effectful:
            grad = node.inputs[_UPDATE_GRAD_INPUT]
            trained += grad.type.numel
            gradients.append(grad)
            row.trained_elements += grad.type.numel
    plan = plan_memory(graph)
    phases = costs.flops_by_phase()
    return Figures(
        trained_elements=trained,
        forward_flops=phases["forward"],
        backward_flops=phases["backward"],
        update_flops=phases["update"],
        saved_activation_bytes=sum(saved.values()),
        param_bytes=plan.param_bytes,
        gradient_bytes=sum(g.type.nbytes for g in gradients),
        gradient_live_bytes=_live_peak(plan, gradients),
        optimizer_state_bytes=plan.state_bytes,
        planned_peak_bytes=plan.planned_peak_bytes,
        layers={k: v for k, v in layers.items() if any(asdict(v).values())},
        frozen_bytes=_frozen_bytes(graph),
    )


def _live_peak(plan: MemoryPlan, values: list[Value]) -> int:
    """The most bytes of ``values`` (node results) alive at once in ``plan``."""
    intervals = [plan.liveness.intervals[v.name] for v in values]
    return Liveness(plan.liveness.num_nodes, {iv.value.name: iv for iv in intervals}).peak_bytes


def _frozen_bytes(graph: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in graph.params:
        if not v.trainable:
            out[str(v.dtype)] = out.get(str(v.dtype), 0) + v.type.nbytes
    return dict(sorted(out.items()))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _gflop(n: int) -> str:
    return f"{n / 1e9:.3f} GFLOP"


_ROWS = (
    ("trained params", "trained_elements", lambda n: f"{n:,}"),
    ("forward", "forward_flops", _gflop),
    ("backward", "backward_flops", _gflop),
    ("saved activations", "saved_activation_bytes", _mib),
    ("params (all)", "param_bytes", _mib),
    ("gradients", "gradient_bytes", _mib),
    ("  alive at once", "gradient_live_bytes", _mib),
    ("optimizer state", "optimizer_state_bytes", _mib),
    ("planned peak", "planned_peak_bytes", _mib),
)


def _wrapped(text: str, width: int = 100) -> list[str]:
    """``text`` in lines of at most ``width`` columns (a long name stays whole), indented
    under the report's title."""
    return textwrap.wrap(
        text,
        width,
        initial_indent="  ",
        subsequent_indent="      ",
        break_long_words=False,
        break_on_hyphens=False,
    )


@dataclass
class Report:
    """A scheme's figures beside full backprop's, for the same model and batch."""

    scheme: str
    ours: Figures
    full: Figures
    placement: Placement | None = None  # a step on several backends: who runs what
    recomputation: Recomputation | None = None  # compile(memory_budget=...): what it recomputes
    kernels: tuple[KernelChoice, ...] = ()  # CBackend(tune=True): each tuned node's kernel
    backend_memory: BackendMemory | None = None  # a backend that plans its own memory (C)

    def ratio(self, key: str) -> float:
        base = getattr(self.full, key)
        return getattr(self.ours, key) / base if base else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scheme": self.scheme,
            "ours": asdict(self.ours),
            "full": asdict(self.full),
        }
        if self.placement is not None:
            out["backends"] = _placement_dict(self.placement)
        if self.recomputation is not None:
            out["recomputation"] = self.recomputation.to_dict()
        if self.kernels:
            out["c_kernels"] = [asdict(k) for k in self.kernels]
        if self.backend_memory is not None:
            out["backend_memory"] = asdict(self.backend_memory)
        return out

    def __str__(self) -> str:
        lines = ["compile-time report", *_wrapped(f"scheme: {self.scheme}")]
        lines.append(f"  {'':<20}{'this scheme':>18}{'full backprop':>18}{'ratio':>8}")
        for label, key, fmt in _ROWS:
            ours, full = getattr(self.ours, key), getattr(self.full, key)
            lines.append(f"  {label:<20}{fmt(ours):>18}{fmt(full):>18}{self.ratio(key):>8.2f}")
        if self.ours.frozen_bytes:
            shown = ", ".join(f"{k} {_mib(n)}" for k, n in self.ours.frozen_bytes.items())
            lines.append(f"  {'frozen weights':<20}{shown}")
        lines.append("")
        width = max([40, *(len(name) + 2 for name in self.full.layers)])  # full names, aligned
        lines.append(
            f"  {'layer':<{width}}{'trained':>10}{'fwd MFLOP':>11}{'bwd MFLOP':>11}"
            f"{'full bwd':>10}{'saved KiB':>11}{'full saved':>11}"
        )
        for name, row in self.full.layers.items():
            mine = self.ours.layers.get(name, LayerFigures())
            lines.append(
                f"  {name:<{width}}{mine.trained_elements:>10,}{row.forward_flops / 1e6:>11.1f}"
                f"{mine.backward_flops / 1e6:>11.1f}{row.backward_flops / 1e6:>10.1f}"
                f"{mine.saved_bytes / 1024:>11.0f}{row.saved_bytes / 1024:>11.0f}"
            )
        if self.placement is not None:
            lines += ["", f"  backends: {self.placement.summary()}"]
            for name, ops in _placement_dict(self.placement)["ops"].items():
                shown = ", ".join(f"{op} x{n}" for op, n in ops.items())
                lines.append(f"    {name}: {shown}")
        if self.recomputation is not None:
            lines += ["", *(f"  {line}" for line in self.recomputation.lines())]
        if self.backend_memory is not None:
            lines += ["", *(f"  {line}" for line in self.backend_memory.lines())]
        if self.kernels:
            total = sum(k.time for k in self.kernels)
            lines += [
                "",
                f"  C kernels (measured at compile time, median; tuned nodes "
                f"{total * 1e3:.1f} ms a step)",
                f"    {'op':<20}{'node':<28}{'kernel':<11}{'time':>13}",
            ]
            lines += [f"    {k.line()}" for k in self.kernels]
        return "\n".join(lines)


def _placement_dict(p: Placement) -> dict[str, Any]:
    """Nodes per backend, the ops each non-primary backend runs, the boundary transfers."""
    ops: dict[str, dict[str, int]] = {name: {} for name in p.backends[1:]}
    for node_op, k in zip(p.ops, p.assignment, strict=True):
        if k:
            row = ops[p.backends[k]]
            row[node_op] = row.get(node_op, 0) + 1
    steps = p.per_step()
    return {
        "nodes": p.nodes_per_backend(),
        "ops": ops,
        "segments": len(p.segments),
        "transfers_per_step": len(steps),
        "transfer_bytes_per_step": p.transfer_bytes,
        "cached_transfers": len(p.transfers) - len(steps),
    }
