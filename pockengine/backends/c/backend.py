"""The C backend: the whole step as compiled C over one arena, called through ctypes.

``CExecutable`` plans the graph's memory (``plan_step.plan_step_memory``), emits its C source
(``.source``, emitted again when read rather than kept), compiles it
(``driver.build_library``, cached by hash) and allocates the arena once:
``plan.arena_bytes``, 64-byte aligned. The ``Store`` holds C-contiguous NumPy
arrays (params, buffers, optimizer state: the state block); ``run`` copies the batch into
the arena at its planned offsets, passes the arrays' pointers to ``pe_step`` (which
writes the updates into them in place and allocates nothing), and copies the outputs
out of the arena.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine._libc import libc_function
from pockengine.backends.base import Backend, Executable, Store
from pockengine.backends.c import (
    lower_chain,
    lower_dw_bn,
    lower_ew,
    lower_layout,
    lower_loss,
    lower_nn,
    lower_quant,
    lower_reduce,
    lower_select,
)
from pockengine.backends.c.budget_fit import fit_budget, memory_of
from pockengine.backends.c.conv_kernels import CONV_OPS, conv_geometry, node_kernel
from pockengine.backends.c.driver import build_library, has_fast_gemm
from pockengine.backends.c.emit import CTYPES, CEmitError, EmitContext, Lowering, emit_step
from pockengine.backends.c.layout import heuristic_nhwc
from pockengine.backends.c.layout_tune import (
    choose_layouts,
    layout_beside,
    layout_of,
    merge_choices,
)
from pockengine.backends.c.lowering import LOWERING_PASSES, lower_for_c
from pockengine.backends.c.shape_tune import GemmShape, choose_shapes, with_shapes
from pockengine.backends.c.tune import KernelChoice, choose_kernels
from pockengine.backends.c.workspace import with_workspace
from pockengine.ir import CompileError, Graph, Node, Role, UnsupportedOpError, print_node
from pockengine.ir.arrays import Array
from pockengine.plan import MemoryPlan
from pockengine.plan.report import BackendMemory

__all__ = ["KERNELS", "BoundStep", "CBackend", "CExecutable"]

KERNELS: dict[str, Lowering] = {
    **lower_ew.KERNELS,
    **lower_reduce.KERNELS,
    **lower_nn.KERNELS,
    **lower_loss.KERNELS,
    **lower_select.KERNELS,
    **lower_quant.KERNELS,
    **lower_layout.KERNELS,
    **lower_dw_bn.KERNELS,
    **lower_chain.KERNELS,
}


def claims(node: Node) -> bool:
    """Whether the C backend can run ``node``: a kernel for its op, and C types for every
    value it reads and writes (no bf16; f16 only as ``lower_quant.half_ok`` allows)."""
    values = (*node.inputs, *node.outputs)
    typed = all(v.dtype in CTYPES for v in values) and lower_quant.half_ok(node)
    return node.op in KERNELS and typed and _emits(node)


class _AnyNames(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "p"


def _emits(node: Node) -> bool:
    """Whether the op's lowering writes ``node`` (some kernels take f32 or f64 only, e.g.
    ``minimum`` on i64 indices): the lowering run once, its C text dropped."""
    ctx = EmitContext(Graph("claim", (), (), ()), MemoryPlan.__new__(MemoryPlan), _AnyNames())
    try:
        if node.op in CONV_OPS:  # the working memory its kernel may take (workspace.py)
            node = with_workspace(node, set())
        KERNELS[node.op](ctx, node)
    except (CEmitError, ValueError):
        return False
    return True


def check_claims(graph: Graph) -> None:
    """One UnsupportedOpError listing every node of ``graph`` the backend cannot run."""
    missing: dict[tuple[str, str], None] = {}
    for node in graph.nodes:
        if not claims(node):
            types = ", ".join(sorted({str(v.dtype) for v in (*node.inputs, *node.outputs)}))
            label = node.op if node.op not in KERNELS else f"{node.op} on {types}"
            missing[(label, node.source)] = None
    if missing:
        raise UnsupportedOpError("ops for the c backend", list(missing))


def _kept_shapes(
    graph: Graph, conv_kernels: Mapping[str, str], shapes: list[GemmShape], fast: bool
) -> dict[str, int]:
    """The micro-kernel shape (its index) of each node that still runs what it was timed
    on after the layout pass and a memory budget (the same op; a convolution, the same
    kernel), where the measurement kept one other than the default."""
    nodes = {n.outputs[0].name: n for n in graph.nodes if n.outputs}
    kept = {}
    for s in shapes:
        node = nodes.get(s.output)
        if node is None or node.op != s.op:
            continue
        if s.kernel and node_kernel(node, conv_geometry(node), conv_kernels, fast) != s.kernel:
            continue
        kept[s.output] = s.index
    return kept


@dataclass(frozen=True)
class BoundStep:
    """One call of the compiled step, ready to make: ``function(arena, args)``."""

    function: Any  # the ctypes function pe_step
    arena: int  # the arena's address
    args: Any  # a ctypes array of the inputs' addresses


class CExecutable(Executable):
    """One graph compiled to a shared library; ``run`` calls its ``pe_step`` once."""

    def __init__(
        self,
        graph: Graph,
        portable: bool | None = None,
        profile: bool = False,
        tune: bool = False,
        threads: int | None = None,
        memory_budget: int | None = None,
    ) -> None:
        graph = lower_for_c(graph)  # low-bit products, batch norm with its hardtanh
        check_claims(graph)
        # tune: each conv node's kernel and layout by measurement (tune.py, layout_tune.py);
        # else the rule's kernels and heuristic_layout's layouts (layout.py)
        # (a node's layout candidates are timed in its kernels' harness call: ``beside``)
        beside: dict[str, dict[str, float]] = {}
        choices = (
            choose_kernels(graph, portable, threads, layout_beside(portable), beside)
            if tune
            else []
        )
        kernels = {c.output: c.kernel for c in choices}
        layouts: dict[str, str] | set[str]
        if tune:
            measured = choose_layouts(graph, kernels, portable, threads, beside)
            choices = merge_choices(choices, measured)
            dtypes = {n.outputs[0].name: n.outputs[0].dtype for n in graph.nodes if n.outputs}
            laid = {c.output: layout_of(c.kernel, dtypes[c.output]) for c in measured}
            layouts = {name: layout for name, layout in laid.items() if layout is not None}
        else:
            layouts = heuristic_nhwc(graph)
        # tune: each GEMM node's micro-kernel shape by measurement (shape_tune.py)
        shapes = choose_shapes(graph, kernels, portable, threads) if tune else []
        # the layouts and the kernels' working memory, less what a memory budget gives up
        seconds = {c.output: c.seconds for c in choices}
        fast = has_fast_gemm(portable)  # the rule's F(2x2, 3x3) range depends on the GEMM
        arranged = fit_budget(graph, kernels, layouts, memory_budget, seconds, fast)
        graph = arranged.graph
        self._gemm_shapes = _kept_shapes(graph, arranged.conv_kernels, shapes, fast)
        choices = with_shapes(choices, [s for s in shapes if s.output in self._gemm_shapes])
        self.graph = graph
        self.plan: MemoryPlan = arranged.plan
        self.memory: BackendMemory = memory_of(arranged, memory_budget)
        self.profiled = profile
        self.kernel_choices: list[KernelChoice] = choices
        self._conv_kernels = arranged.conv_kernels
        # The source (0.5 MB for MobileNetV2) is not kept: ``source`` emits it again.
        self.library_path = build_library(self.source, portable)
        self._lib = ctypes.CDLL(str(self.library_path))
        self._fn = self._lib.pe_step
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = None
        size = max(self.plan.arena_bytes, 64)
        self._buffer = np.zeros(size + 64, dtype=np.uint8)  # the arena, allocated once
        start = (-self._buffer.ctypes.data) % 64
        self.arena: Array = self._buffer[start : start + size]
        self._address = int(self.arena.ctypes.data)
        self._trim = libc_function("malloc_trim")
        if self._trim is not None:
            self._trim(0)  # what emitting and building the source freed, before the arena fills
        self._args = (ctypes.c_void_p * max(len(graph.inputs), 1))()
        self._inputs = tuple(graph.inputs)
        results = (v for n in graph.nodes for v in n.outputs)
        self._types = {v.name: v.type for v in (*graph.inputs, *results)}

    @property
    def source(self) -> str:
        """The step's C source (emitted again on each read; the library is built from it)."""
        return emit_step(
            self.graph,
            self.plan,
            KERNELS,
            profile=self.profiled,
            conv_kernels=self._conv_kernels,
            gemm_shapes=self._gemm_shapes,
        )

    def _view(self, name: str) -> Array:
        """The arena bytes of value ``name`` as an array of its type."""
        t = self._types[name]
        if t.nbytes == 0:  # the plan places only values with bytes
            return np.empty(t.shape, t.dtype.to_numpy())
        offset = self.plan.offsets[name]
        return self.arena[offset : offset + t.nbytes].view(t.dtype.to_numpy()).reshape(t.shape)

    def bind(self, store: Store, feeds: Mapping[str, Any]) -> BoundStep:
        """Copy the batch into the arena and point the arguments at the state block."""
        for k, v in enumerate(self._inputs):
            if v.role in (None, Role.INPUT) and v.name in feeds:
                if v.type.nbytes == 0:
                    self._args[k] = self._address
                    continue
                self._view(v.name)[...] = feeds[v.name]
                self._args[k] = self._address + self.plan.offsets[v.name]
                continue
            if v.name not in store:
                raise CompileError(f"graph {self.graph.name} is missing input {v.name!r}")
            array = store[v.name]
            ok = isinstance(array, np.ndarray) and array.flags.c_contiguous
            if not (ok and array.dtype == v.dtype.to_numpy()):
                array = store[v.name] = np.ascontiguousarray(array, dtype=v.dtype.to_numpy())
            self._args[k] = array.ctypes.data
        return BoundStep(self._fn, self._address, self._args)

    def node_seconds(self) -> list[tuple[float, str]]:
        """With ``profile=True``: seconds spent in each node over every run so far, with the
        node's IR text, slowest first."""
        if not self.profiled:
            raise CompileError("compile with CBackend(profile=True) to time the nodes")
        n = len(self.graph.nodes)
        times = (ctypes.c_double * n).in_dll(self._lib, "pe_node_seconds")
        texts = [print_node(node) for node in self.graph.nodes]
        return sorted(zip(list(times), texts, strict=True), reverse=True)

    def run(self, store: Store, feeds: Mapping[str, Any] | None = None) -> list[Array]:
        bound = self.bind(store, feeds or {})
        bound.function(bound.arena, bound.args)
        if self._trim is not None:
            # Once, after the first step: the heap that compiling freed (traced graphs, the
            # copies of the weights the caller dropped since) goes back to the OS. Later
            # steps allocate only their outputs, so there is nothing more to give back.
            self._trim(0)
            self._trim = None
        index = {v.name: k for k, v in enumerate(self._inputs)}
        outs = []
        for v in self.graph.outputs:
            if v.name in index and v.name not in self.plan.offsets:
                outs.append(np.array(store[v.name], copy=True))
            else:
                outs.append(np.array(self._view(v.name), copy=True))
        return outs


class CBackend(Backend):
    """Compiled C over a static arena (see the module docstring); ``portable`` builds
    without ``-march=native``, ``threads`` sets the OpenMP thread count, ``profile`` times
    every node (``CExecutable.node_seconds``). ``tune`` times every valid kernel of each
    convolution node at compile time and keeps the fastest (``tune.py``; cached, so a
    second compile measures nothing), then times NHWC against it where an NHWC kernel
    exists (``layout_tune.py``); off by default, when each node takes the kernel of
    ``conv_kernels.rule_kernel`` and the layout of ``layout.heuristic_layout``.
    ``memory_budget`` (bytes; ``pe.compile(..., memory_budget=...)`` sets it) caps the
    arena plan: kernels' working memory and NHWC layouts are given up until the plan fits
    (``budget_fit.py``; ``step.report()`` lists what was)."""

    name = "c"

    def __init__(
        self,
        portable: bool | None = None,
        threads: int | None = None,
        profile: bool = False,
        tune: bool = False,
        memory_budget: int | None = None,
    ) -> None:
        if memory_budget is not None and not (
            isinstance(memory_budget, int)
            and not isinstance(memory_budget, bool)
            and memory_budget > 0
        ):
            raise CompileError(f"CBackend: memory_budget must be bytes > 0, got {memory_budget!r}")
        self.portable = portable
        self.threads = threads
        self.profile = profile
        self.tune = tune
        self.memory_budget = memory_budget

    def under_budget(self, budget: int) -> CBackend:
        """This backend with its arena plan capped at ``budget`` bytes (a copy)."""
        return CBackend(self.portable, self.threads, self.profile, self.tune, budget)

    def compile(self, graph: Graph) -> CExecutable:
        executable = CExecutable(
            graph, self.portable, self.profile, self.tune, self.threads, self.memory_budget
        )
        if self.threads is not None:
            executable._lib.pe_set_threads(ctypes.c_int(self.threads))
        return executable

    def supported_ops(self) -> frozenset[str]:
        return frozenset(KERNELS)

    def lowering_passes(self) -> tuple[Callable[[Graph], Graph], ...]:
        """Rewrites the training pipeline ends with for this backend (``pe.compile`` runs
        them before a memory budget plans): products and the loss head on low-bit frozen
        matrices read the codes (``fuse_lowbit.py``); batch norm and the hardtanh after it
        run as one kernel each way (``fuse_bn.py``)."""
        return LOWERING_PASSES

    def claims(self, node: Node) -> bool:
        return claims(node)

    def holds(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def from_numpy(self, array: Array) -> Array:
        return np.array(array, order="C")  # a copy the state block owns

    def feed(self, array: Array) -> Array:
        return array  # ``bind`` copies it into the arena

    def share_numpy(self, array: Array) -> Array:
        """``array`` itself (read-only) when C-ordered: the step only reads it (a frozen
        weight, a constant), so the state block points at the caller's memory instead of
        holding a second copy; ``bind`` copies it once if its dtype is not the graph's."""
        if not array.flags.c_contiguous:
            return self.from_numpy(array)
        shared = array.view()
        shared.flags.writeable = False
        return shared

    def share_written(self, array: Array) -> Array:
        """``array`` itself: ``pe_step`` writes the updates through its pointer."""
        return array

    def to_numpy(self, tensor: Any) -> Array:
        return np.asarray(tensor)
