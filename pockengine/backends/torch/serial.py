"""Kernels that run on one thread where that is faster, chosen by measurement at compile time.

ATen's elementwise and reduction kernels stay on the calling thread below 32,768
elements, but a few CPU kernels open an OpenMP parallel region at any size: batch norm
(3 regions forward and 1 backward on NCHW tensors, 6 and 3 channels-last) and the fused
optimizer updates (one per tensor from about 1,000 elements). On a small model each such
region holds microseconds of work, and it wakes the pool's threads and waits at its end
for all of them; when the cores are shared, a thread the OS has not yet scheduled stalls
the step for up to a time slice (MobileNetV2 width 0.35 at 128 px, batch 1, 2 threads: a
batch norm of 336 x 4 x 4 took 0.8-2.9 ms on all threads against 25-60 us on one, on the
loaded 2-core machine; docs/benchmarks.md, "The torch backend against eager").

For each node of such a kernel (``batch_norm``, ``batch_norm_grad``, the fused SGD and
AdamW updates) on the CPU, compiling times the kernel on stand-in tensors of the node's
shapes, in turn on all threads and on one (``torch.set_num_threads(1)`` around the call,
0.3 us the pair), and the generated line calls it through ``pe_serially`` where one
thread was faster (mean of ``ROUNDS``; a kernel of ``LARGE_S`` (100 us) or more on one
thread stays on all, timed twice). A 4-D stand-in is channels-last, as the
backend stores the images and trained convolution weights by default. The choices are
kept per process, keyed by (kernel, shapes, dtype, threads); with one thread there is
nothing to choose and nothing is measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit
from pockengine.backends.torch.kernels import torch_dtype
from pockengine.ir import TensorType

__all__ = [
    "LARGE_S",
    "NAMESPACE",
    "ROUNDS",
    "Probes",
    "choices",
    "on_one_thread",
    "serial_call",
    "serially",
    "stand_in",
]

ROUNDS = 7
LARGE_S = 1e-4
_CHOICES: dict[tuple[Any, ...], bool] = {}

Probe = Callable[[], object]


def serially(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ATen (OpenMP, MKL) on one thread, then the threads as
    they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def choices() -> dict[tuple[Any, ...], bool]:
    """The choices made so far in this process: key -> whether one thread was faster."""
    return dict(_CHOICES)


def _seconds(run: Callable[[Probe], object], probe: Probe) -> float:
    start = time.perf_counter()
    run(probe)
    return time.perf_counter() - start


def _one_thread_faster(probe: Probe) -> bool:
    """Whether ``probe`` runs faster on one thread than on all: the means of ``ROUNDS``
    timings each (a step's time is the sum of its calls', stalls included), taken in turn
    so both see the same load. A kernel taking ``LARGE_S`` or more on one thread (the faster
    of two calls) stays on all of them, measured no further: its regions' costs are small
    beside its work (MobileNetV2 at batch 8: with a 1 ms bound, the 37 kernels under it
    that chose one thread made the sparse step 1.38x slower, in one process), and timing
    it would lengthen the compile (7 s of CPU time with no bound)."""
    probe()
    if min(_seconds(serially, probe) for _ in range(2)) >= LARGE_S:
        return False
    threaded, single = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        probe()
        middle = time.perf_counter()
        serially(probe)
        threaded.append(middle - start)
        single.append(time.perf_counter() - middle)
    return statistics.fmean(single) < statistics.fmean(threaded)


def on_one_thread(e: Emit, kernel: str, make_probe: Callable[[Emit], Probe]) -> bool:
    """Whether node ``e``'s ``kernel`` runs on one thread: measured once per process for
    its input shapes and dtypes (``make_probe`` builds the stand-in call) on the CPU with
    more than one thread, else no."""
    threads = torch.get_num_threads()
    if e.device.type != "cpu" or threads == 1:
        return False
    shapes = tuple((v.shape, str(v.dtype)) for v in e.node.inputs)
    key = (kernel, shapes, threads)
    if key not in _CHOICES:
        _CHOICES[key] = _one_thread_faster(make_probe(e))
    return _CHOICES[key]


def serial_call(e: Emit, callee: str, args: str, make_probe: Callable[[Emit], Probe]) -> str:
    """The source of ``callee(args)``, through ``pe_serially`` where one thread was faster
    (``on_one_thread``)."""
    if on_one_thread(e, callee, make_probe):
        return f"pe_serially({callee}, {args})"
    return f"{callee}({args})"


def stand_in(value_type: TensorType, device: torch.device, fill: float = 0.0) -> torch.Tensor:
    """A tensor of ``value_type``'s shape and dtype filled with ``fill``; channels-last
    when 4-D."""
    layout = torch.channels_last if value_type.rank == 4 else torch.contiguous_format
    tensor = torch.empty(
        value_type.shape,
        dtype=torch_dtype(value_type.dtype),
        device=device,
        memory_format=layout,
    )
    return tensor.fill_(fill)


def _inputs(e: Emit, fills: dict[int, float] | None = None) -> list[torch.Tensor]:
    fills = fills or {}
    return [stand_in(v.type, e.device, fills.get(i, 0.0)) for i, v in enumerate(e.node.inputs)]


def _updated_part(e: Emit) -> torch.Tensor:
    """A stand-in of what an update writes: the param, or (a ``rows`` update) the part of
    it the gradient covers; the fused kernels index all their lists by the param's size."""
    return stand_in(e.node.inputs[1].type, e.device)


class Probes:
    """Stand-in calls of the kernels that may run on one thread, one per kernel: each
    takes the node and returns the call to time."""

    @staticmethod
    def batch_norm(e: Emit) -> Probe:
        """ATen's training-mode batch norm on stand-ins of ``batch_norm``'s inputs."""
        x, w, b = _inputs(e)
        eps = float(e.attr("eps"))
        return lambda: torch.native_batch_norm(x, w, b, None, None, True, 0.0, eps)

    @staticmethod
    def batch_norm_grad(e: Emit) -> Probe:
        """ATen's batch-norm backward on stand-ins of ``batch_norm_grad``'s inputs (1/std 1)."""
        gy, x, w, mean, invstd = _inputs(e, {4: 1.0})
        eps, mask = float(e.attr("eps")), list(e.used)
        backward = torch.ops.aten.native_batch_norm_backward.default
        return lambda: backward(gy, x, w, None, None, mean, invstd, True, eps, mask)

    @staticmethod
    def fused_sgd(e: Emit) -> Probe:
        """ATen's fused SGD on stand-ins of an SGD update's param, gradient and momentum
        (a zero learning rate)."""
        _, g, *rest = _inputs(e)
        w = _updated_part(e)
        momentum = float(e.get("momentum", 0.0))
        buf = [rest[0]] if momentum else []
        return lambda: torch._fused_sgd_(
            [w], [g], buf, weight_decay=0.0, momentum=momentum, lr=0.0, dampening=0.0,
            nesterov=False, maximize=False, is_first_step=False,
        )  # fmt: skip

    @staticmethod
    def fused_adamw(e: Emit) -> Probe:
        """ATen's fused AdamW on stand-ins of ``adamw_update``'s param, gradient, moments and
        step count (a zero learning rate)."""
        _, g, m, v, t = _inputs(e, {4: 1.0})[:5]
        w = _updated_part(e)
        return lambda: torch._fused_adamw_(
            [w], [g], [m], [v], [], [t], lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0,
            eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip


NAMESPACE: dict[str, Callable[..., Any]] = {"pe_serially": serially}
