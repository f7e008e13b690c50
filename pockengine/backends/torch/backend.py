"""The torch backend: a graph compiles to one generated Python function calling ATen.

``TorchBackend.compile`` writes the whole graph as the source of one straight-line
function (``codegen``; the lines come from the kernel tables in ``kernels``,
``kernels_shape`` and ``kernels_nn``), compiles it with ``compile()`` and binds
the ATen kernels, dtypes, the device and the compile-time constants as its globals (a
large source is parsed in a forked child, ``bytecode``).
Running it is one call under ``torch.inference_mode()``: no autograd, no interpreter
loop, no per-op lookups. The source is the executable's ``.source``; line
``first_line + k`` is node ``k``, so an error raised by a kernel names its node.

Params, buffers and optimizer state stay in the ``Store`` as tensors on the device and
are updated in place by the effectful nodes. Tensors written in inference mode are
normal tensors still (only tensors *created* there are inference tensors), so the store
can be read and used with autograd outside.
"""

from __future__ import annotations

import functools
import itertools
import linecache
import math
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pockengine._libc import libc_function
from pockengine.backends.base import Backend, Executable, NotShareableError, Store, check_ops
from pockengine.backends.torch import kernels as torch_kernels
from pockengine.backends.torch import kernels_attn as torch_kernels_attn
from pockengine.backends.torch import kernels_chain as torch_kernels_chain
from pockengine.backends.torch import kernels_layout as torch_kernels_layout
from pockengine.backends.torch import kernels_loss as torch_kernels_loss
from pockengine.backends.torch import kernels_nn as torch_kernels_nn
from pockengine.backends.torch import kernels_norm_act as torch_kernels_norm_act
from pockengine.backends.torch import kernels_optim as torch_kernels_optim
from pockengine.backends.torch import kernels_quant as torch_kernels_quant
from pockengine.backends.torch import kernels_select as torch_kernels_select
from pockengine.backends.torch import kernels_shape as torch_kernels_shape
from pockengine.backends.torch import kernels_stats as torch_kernels_stats
from pockengine.backends.torch import serial as torch_serial
from pockengine.backends.torch.bytecode import code_object
from pockengine.backends.torch.codegen import Emitter, PairFinder, generate_source
from pockengine.backends.torch.heap import (
    LARGE_SLOT_BYTES,
    MMAP_THRESHOLD_MAX,
    WORKSPACE_OPS,
    Workspace,
    checked_thresholds,
    fix_heap_thresholds,
    keep_step_heap,
    plan_workspace,
    trim_points,
)
from pockengine.backends.torch.kernels import torch_dtype
from pockengine.backends.torch.stored import is_dense, stored_layout
from pockengine.ir import CompileError, DType, Graph, PockEngineError, get_op, print_node
from pockengine.ir.arrays import Array
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import liveness

__all__ = [
    "KERNELS",
    "TorchBackend",
    "TorchExecutable",
    "TorchKernelError",
    "keep_freed_heap",
    "stored_layout",
]


KERNELS: dict[str, Emitter] = {
    **torch_kernels.KERNELS,
    **torch_kernels_shape.KERNELS,
    **torch_kernels_nn.KERNELS,
    **torch_kernels_attn.KERNELS,
    **torch_kernels_loss.KERNELS,
    **torch_kernels_quant.KERNELS,
    **torch_kernels_norm_act.KERNELS,
    **torch_kernels_chain.KERNELS,
    **torch_kernels_layout.KERNELS,
    **torch_kernels_optim.KERNELS,
    **torch_kernels_select.KERNELS,
    **torch_kernels_stats.KERNELS,  # batch_norm and assign, absorbing what follows them
}
_FINDERS: dict[str, PairFinder] = {**torch_kernels.FINDERS, **torch_kernels_nn.FINDERS}
_NAMESPACE: dict[str, Any] = {
    **torch_kernels.NAMESPACE,
    **torch_kernels_shape.NAMESPACE,
    **torch_kernels_nn.NAMESPACE,
    **torch_kernels_attn.NAMESPACE,
    **torch_kernels_quant.NAMESPACE,
    **torch_kernels_loss.NAMESPACE,
    **torch_kernels_optim.NAMESPACE,
    **torch_kernels_select.NAMESPACE,
    **torch_kernels_layout.NAMESPACE,
    **torch_serial.NAMESPACE,
    **torch_kernels_stats.NAMESPACE,
    **{f"dt_{d}": torch_dtype(d) for d in DType},
    "inf": math.inf,
    "nan": math.nan,
}
_serial = itertools.count()


class TorchKernelError(PockEngineError):
    """A kernel that failed (or would fail) at run time; the message names the node and its
    source, or the stored tensors at fault."""


class TorchExecutable(Executable):
    """One graph as a generated function; ``run`` calls it once."""

    def __init__(
        self,
        graph: Graph,
        device: torch.device,
        inplace: bool = True,
        trim_heap: bool = False,
        trim_peak: bool = False,
        workspace: bool = False,
        large_slots: bool = False,
    ) -> None:
        check_ops(graph, KERNELS, "torch")
        self.graph = graph
        self.device = device
        self._trim = libc_function("malloc_trim") if trim_heap else None
        reuse = reusable_inputs(graph) if inplace else {}
        # the planned peak of live intermediates: what the step heap keeps (``heap``)
        self.live_peak = liveness(graph, reuse).peak_bytes
        # the nodes after which the run trims the heap (``heap``); none with a
        # workspace, which holds the large results whose pages the trims would give back
        points = trim_points(graph, reuse) if trim_peak and not workspace else ()
        peak_trim = libc_function("malloc_trim") if points else None
        self.trim_points = points if peak_trim is not None else ()
        after = dict.fromkeys(self.trim_points, "heap_trim(0)")
        # the large results' slots in one buffer kept between calls (``heap``); with
        # ``large_slots`` alone, the results above glibc's mmap ceiling only
        planned = None
        if workspace or large_slots:
            least = None if workspace else LARGE_SLOT_BYTES
            planned = plan_workspace(graph, reuse, WORKSPACE_OPS, least)
        self.workspace: Workspace | None = planned
        self._arena = _arena(planned, device)
        slots = None if self._arena is None or planned is None else (self._arena, planned.offsets)
        generated = generate_source(
            graph, KERNELS, _FINDERS, device, reuse, after, slots, torch_kernels_stats.ABSORBERS
        )
        self._first_line = generated.first_line
        self._filename = f"<pockengine-torch {graph.name} #{next(_serial)}>"
        # Registered with linecache (while the executable lives) so that tracebacks and
        # debuggers show the generated lines; the lines are the only copy of the source
        # kept (``source`` joins them: the MCU head step's is 0.1 MiB)
        self._lines = generated.source.splitlines(keepends=True)
        entry = (len(generated.source), None, self._lines, self._filename)
        linecache.cache[self._filename] = entry
        weakref.finalize(self, linecache.cache.pop, self._filename, None)
        namespace = {**_NAMESPACE, **generated.constants, "dev": device, "heap_trim": peak_trim}
        # parsed in a forked child where it is large (``bytecode``): the parser's garbage
        # stays out of the training process
        exec(code_object(generated.source, self._filename), namespace)
        self.function: types.FunctionType = namespace[generated.function]
        self._inputs = tuple(v.name for v in graph.inputs)
        # The fused optimizer kernels index raw memory: what they write must be dense, in the
        # layout the store gives it (``stored_layout``).
        written = {n.inputs[j].name for n in graph.nodes for j in get_op(n.op).mutates}
        self._written = tuple(k for k, name in enumerate(self._inputs) if name in written)

    @property
    def source(self) -> str:
        """The generated function's source (joined again on each read)."""
        return "".join(self._lines)

    def run(self, store: Store, feeds: Mapping[str, Any] | None = None) -> list[Any]:
        """Run once on ``store`` (params and state, written in place) and ``feeds``."""
        feeds = feeds or {}
        try:
            args = [feeds[n] if n in feeds else store[n] for n in self._inputs]
        except KeyError:
            missing = [n for n in self._inputs if n not in store and n not in feeds]
            raise CompileError(f"graph {self.graph.name} is missing inputs {missing}") from None
        bad = [self._inputs[k] for k in self._written if not is_dense(args[k])]
        if bad:
            raise TorchKernelError(
                f"stored tensors written in place must be dense (row-major or channels-last): {bad}"
            )
        try:
            with torch.inference_mode():
                results = list(self.function(*args))
        except Exception as exc:
            node = self._failed_node(exc)
            if node is None:
                raise
            raise TorchKernelError(f"{type(exc).__name__} in {node}: {exc}") from exc
        finally:
            if self._trim is not None:
                # The step's intermediates are freed; give back the heap pages they held
                # (see TorchBackend, ``trim_heap``).
                self._trim(0)
        return results

    def _failed_node(self, exc: BaseException) -> str | None:
        """The printed node whose line of the generated source raised ``exc``."""
        tb = exc.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self._filename:
                line = tb.tb_lineno
            tb = tb.tb_next
        if line is None or not 0 <= line - self._first_line < len(self.graph.nodes):
            return None
        return print_node(self.graph.nodes[line - self._first_line])


def _arena(workspace: Workspace | None, device: torch.device) -> torch.Tensor | None:
    """The workspace's buffer (uint8; its pages are mapped at the first call's writes)."""
    if workspace is None or not workspace.offsets:
        return None
    return torch.empty(workspace.nbytes, dtype=torch.uint8, device=device)


_TRIM_THRESHOLD = 2**30  # keep_freed_heap's


@functools.cache
def keep_freed_heap() -> bool:
    """Let the process keep and reuse all freed CPU memory: glibc's mmap threshold at its
    32 MiB ceiling and the trim threshold at 1 GiB, once per process
    (``heap.fix_heap_thresholds``); the resident size then stays at the process's
    high-water mark. True if set (False off glibc). The default (``heap.keep_step_heap``)
    keeps only what the compiled steps need; this is the older, unbounded opt-in:
    ``TorchBackend(keep_heap=True)``."""
    return fix_heap_thresholds(MMAP_THRESHOLD_MAX, _TRIM_THRESHOLD)


class TorchBackend(Backend):
    """ATen kernels on ``device`` ("cpu" or "cuda"), called from generated code.

    Layout (``channels_last``): what the step writes (trained params, buffers, optimizer
    state) and the batch are stored channels-last when 4-D (``stored_layout``); what it only
    reads (frozen weights, constants) keeps the layout it arrives in and is shared, not
    copied, unless ``frozen_channels_last``. A convolution runs channels-last when its input
    is, whatever its weight's layout, and oneDNN reorders the weight into its own blocked
    format on every call either way, so a channels-last copy of a frozen weight costs its
    size in memory and saves no measurable time.

    Heap (CPU). By default (``step_heap``) compiling fixes glibc's thresholds so the heap
    keeps the step's own buffers between runs (``heap.keep_step_heap``: mmap
    threshold 32 MiB, trim threshold twice the largest planned live peak so far): a
    steady step reuses the pages the last one freed and takes no page faults, where
    glibc's adaptive thresholds handed the step's heap back at its end and mapped it again
    at the next (MobileNetV2 sparse, batch 8: 42,000 minor faults a step before, 0 now;
    docs/benchmarks.md, "The torch backend against eager"). Process-wide, as glibc's
    settings are; raised, never lowered, by later compiles; left alone once ``keep_heap``
    or ``heap_thresholds`` chose thresholds. A block of at least 32 MiB (glibc's ceiling on
    the mmap threshold) never comes from the heap: with the step heap (unless
    ``large_slots=False``) the results of at least ``torch_heap.LARGE_SLOT_BYTES`` that the
    workspace's kernels can write into a given tensor get slots in a buffer the
    executable keeps (``torch_heap.plan_workspace``), mapped once instead of at every run
    (the LLaMA benchmark's 62.5 MiB lm_head gradient: 16,000 minor faults a step before,
    none now); the executable is then not re-entrant. Opt-in, all of which turn the step
    heap off:
    ``trim_heap`` ends each run by handing the heap pages its freed intermediates held back
    to the OS (glibc's ``malloc_trim``; this call only), so the resident memory between
    steps is what stays live and the next step faults its pages in again (MobileNetV2, 2
    threads: 5-15 MiB less whole-process memory, the sparse step 1.5x slower);
    ``trim_peak``: a graph whose planned live peak is large trims the heap inside the run,
    after the nodes near that peak that free much (``heap.trim_points``), so the
    free blocks the peak does not reuse are not resident at it (minilm-bbc's sparse step:
    555-559 MiB of process peak against 603-612 under glibc's adaptive thresholds, and
    about 13% more CPU time a step, as the trimmed pages fault back in); ``keep_heap``
    keeps all freed memory, unbounded (``keep_freed_heap``); ``heap_thresholds``: glibc's
    mmap and trim thresholds fixed at ``(mmap_bytes, trim_bytes)``
    (``heap.fix_heap_thresholds``), at compile; with the workspace, the resident
    size then follows the live bytes, and ``(2 << 20, 8 << 20)`` takes no page faults in
    a steady LoRA step (docs/benchmarks.md). Opt-in, ``workspace``: the large
    results of matmuls, linears, elementwise, concat, pad and sum nodes
    (``heap.WORKSPACE_OPS``) are written with ``out=`` into one buffer each
    executable allocates once and keeps, at offsets planned from the graph
    (``heap.plan_workspace``): no allocator, no page faults and no fragmentation for
    them, bit for bit the same results; the buffer stays resident between calls (so an
    executable is not re-entrant), and the run makes no trims inside it."""

    name = "torch"

    def __init__(
        self,
        device: str = "cpu",
        channels_last: bool = True,
        keep_heap: bool = False,
        inplace: bool = True,
        trim_heap: bool = False,
        frozen_channels_last: bool = False,
        trim_peak: bool = False,
        workspace: bool = False,
        heap_thresholds: tuple[int, int] | None = None,
        step_heap: bool = True,
        large_slots: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.workspace = workspace
        self.heap_thresholds = checked_thresholds(heap_thresholds, keep_heap)
        self.channels_last = channels_last
        self.keep_heap = keep_heap
        self.inplace = inplace  # elementwise results over dying inputs (plan.inplace)
        self.trim_heap = trim_heap and not keep_heap and self.device.type == "cpu"
        self.frozen_channels_last = frozen_channels_last
        self.trim_peak = trim_peak and not keep_heap and self.device.type == "cpu"
        chosen = keep_heap or self.heap_thresholds is not None  # the user's thresholds
        self.step_heap = (
            step_heap
            and self.device.type == "cpu"
            and not chosen
            and not self.trim_heap
            and not self.trim_peak
        )
        self.large_slots = large_slots and self.step_heap

    def compile(self, graph: Graph) -> TorchExecutable:
        if self.keep_heap and self.device.type == "cpu":
            keep_freed_heap()
        if self.heap_thresholds is not None and self.device.type == "cpu":
            fix_heap_thresholds(*self.heap_thresholds)
        executable = TorchExecutable(
            graph,
            self.device,
            self.inplace,
            self.trim_heap,
            self.trim_peak,
            self.workspace,
            large_slots=self.large_slots,
        )
        if self.step_heap:
            keep_step_heap(executable.live_peak)
        return executable

    def from_numpy(self, array: Array) -> torch.Tensor:
        """A copy on the device, same dtype (the array is never aliased), in the stored
        layout."""
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            array = np.array(array, order="C")  # (ascontiguousarray would make 0-d 1-d)
        with warnings.catch_warnings():  # a read-only array is only read: no NumPy copy first
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            source = torch.from_numpy(array)
        layout = stored_layout(source, self.channels_last)
        out = torch.empty(
            source.shape, dtype=source.dtype, device=self.device, memory_format=layout
        )
        return out.copy_(source)  # the one copy

    def share_numpy(self, array: Array) -> torch.Tensor:
        """A CPU tensor over ``array``'s own memory when it is row-major (4-D ones too,
        unless ``frozen_channels_last``): the step never writes these values (plan.inplace
        writes only over intermediates, updates only their targets)."""
        array = np.asarray(array)
        copy_4d = self.frozen_channels_last and self.channels_last and array.ndim == 4
        if self.device.type != "cpu" or not array.flags.c_contiguous or copy_4d:
            return self.from_numpy(array)
        with warnings.catch_warnings():  # read-only arrays: read, never written (above)
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(array)

    def share_written(self, array: Array) -> torch.Tensor:
        """A CPU tensor over ``array``'s memory, which the fused updates write in place;
        not a 4-D one while the backend stores written 4-D values channels-last (their
        optimizer state is, and the fused kernels index raw memory)."""
        if self.device.type != "cpu":
            raise NotShareableError(f"the torch backend on {self.device} keeps a device copy")
        if self.channels_last and array.ndim == 4:
            raise NotShareableError(
                "the torch backend stores a written 4-D value channels-last "
                "(TorchBackend(channels_last=False) trains it in place)"
            )
        return torch.from_numpy(array)

    def supported_ops(self) -> frozenset[str]:
        return frozenset(KERNELS)

    def holds(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def to_numpy(self, tensor: Any) -> Array:
        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return np.asarray(t.cpu().numpy(), order="C")
