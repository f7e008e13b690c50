"""The torch backend's default step heap (``backends.torch.heap.keep_step_heap``).

- compiling with the default options fixes glibc's mmap threshold at its ceiling and
  raises (never lowers) the trim threshold to twice the largest planned live peak;
  explicit heap options, the opt-in trims and other devices leave glibc alone, and
  so does an explicit choice of thresholds made earlier in the process;
- in a fresh process, a steady run of a graph holding 96 MiB of intermediates takes no
  page faults with the default options, where glibc's adaptive thresholds
  (``step_heap=False``) map and fault the step's heap again at every run;
- training is bit for bit the same with and without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import ir, zoo
from pockengine.backends.torch import heap as torch_heap
from pockengine.backends.torch.backend import TorchBackend

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def _chain(n: int, shape: tuple[int, ...]) -> ir.Graph:
    """``n`` negations of ``x`` in a chain, all live until they are summed at the end."""
    b = ir.GraphBuilder("chain")
    x = b.input("x", ir.TensorType(shape, ir.DType.F32))
    hs = [b.call("neg", x)]
    for _ in range(n - 1):
        hs.append(b.call("neg", hs[-1]))
    total = hs[0]
    for h in hs[1:]:
        total = b.call("add", total, h)
    return b.build([total])


@pytest.fixture
def mallopt(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """glibc's ``mallopt`` replaced by a recorder, and the module's record of what it set
    made fresh (process-wide state: other tests may have chosen thresholds before)."""
    calls: list[tuple[int, int]] = []
    real: Callable[[str], Any] = torch_heap.libc_function

    def fake(name: str) -> Any:
        return (lambda p, v: calls.append((p, v)) or 1) if name == "mallopt" else real(name)

    monkeypatch.setattr(torch_heap, "libc_function", fake)
    monkeypatch.setattr(torch_heap, "_SET", torch_heap._Thresholds())
    return calls


def test_default_compile_keeps_the_step_heap(mallopt: list[tuple[int, int]]) -> None:
    mmap, trim = -3, -1  # glibc's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    small = TorchBackend().compile(_chain(4, (64, 64)))
    assert small.live_peak > 0
    floor = 2 * torch_heap.MMAP_THRESHOLD_MAX  # glibc's ratio: trim = 2 x mmap threshold
    assert mallopt == [(mmap, torch_heap.MMAP_THRESHOLD_MAX), (trim, floor)]
    assert torch_heap.kept_trim_threshold() == floor
    mallopt.clear()
    big = TorchBackend().compile(_chain(40, (256, 1024)))  # 1 MiB each: a 40+ MiB peak
    assert big.live_peak > floor // 2
    assert mallopt == [(mmap, torch_heap.MMAP_THRESHOLD_MAX), (trim, 2 * big.live_peak)]
    mallopt.clear()
    TorchBackend().compile(_chain(4, (64, 64)))  # never lowered
    assert mallopt == [] and torch_heap.kept_trim_threshold() == 2 * big.live_peak


@pytest.mark.parametrize(
    "kwargs",
    [{"step_heap": False}, {"trim_heap": True}, {"trim_peak": True}, {"device": "meta"},
     {"keep_heap": True}, {"heap_thresholds": (2 * MIB, 8 * MIB)}],
)  # fmt: skip
def test_explicit_heap_options_turn_the_step_heap_off(
    mallopt: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any]
) -> None:
    from pockengine.backends.torch import backend as torch_backend

    explicit: list[tuple[int, int]] = []
    monkeypatch.setattr(torch_backend, "keep_freed_heap", lambda: explicit.append((0, 0)) or True)
    monkeypatch.setattr(torch_backend, "fix_heap_thresholds", lambda *a: explicit.append(a) or True)
    backend = TorchBackend(**kwargs)
    assert not backend.step_heap
    if kwargs != {"device": "meta"}:
        backend.compile(_chain(4, (64, 64)))
    assert mallopt == [] and torch_heap.kept_trim_threshold() == 0


def test_an_explicit_choice_is_left_alone(mallopt: list[tuple[int, int]]) -> None:
    torch_heap.fix_heap_thresholds.__wrapped__(2 * MIB, 8 * MIB)  # as TorchBackend(heap_...)
    assert mallopt == [(-3, 2 * MIB), (-1, 8 * MIB)]
    assert TorchBackend().step_heap
    TorchBackend().compile(_chain(4, (64, 64)))
    assert torch_heap.keep_step_heap(100 * MIB) is False
    assert mallopt == [(-3, 2 * MIB), (-1, 8 * MIB)] and torch_heap.kept_trim_threshold() == 0


_PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_torch_step_heap import _chain
    from pockengine.backends.torch.backend import TorchBackend
    torch.set_num_threads(1)
    graph, feed, out = _chain(24, (1024, 1024)), {"x": torch.ones(1024, 1024)}, []
    # the control hands the heap back after every run (malloc_trim): each run faults its
    # 96 MiB of intermediates in again, whatever glibc's adaptive thresholds did before
    backend = TorchBackend(trim_heap=True) if sys.argv[2] == "control" else TorchBackend()
    run = backend.compile(graph)
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run.run({}, feed)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(out))
    """
)


def _faults_per_run(kind: str) -> list[int]:
    """Minor page faults of each of six runs of a 96 MiB chain, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", _PROBE, str(ROOT / "tests"), kind]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    faults: list[int] = json.loads(done.stdout.strip().splitlines()[-1])
    return faults


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's heap and /proc: Linux")
def test_a_steady_default_run_takes_no_page_faults() -> None:
    control, default = _faults_per_run("control"), _faults_per_run("default")
    # runs 4-6: 96 MiB of intermediates (24,576 pages); the probe sees them faulted in
    # afresh when the heap is handed back between runs, and the default reuses them
    assert min(control[3:]) > 4096, control
    assert max(default[3:]) < 64, default


def test_training_is_bit_identical_with_the_step_heap() -> None:
    runs = {}
    for key, backend in (("default", TorchBackend()), ("adaptive", TorchBackend(step_heap=False))):
        w = zoo.small_cnn()
        step = pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.SGD(lr=0.1, momentum=0.9),
                          pe.schemes.full(), backend=backend, compile_in="process")  # fmt: skip
        losses = [step(*w.make_batch(i)) for i in range(3)]
        runs[key] = (losses, step.state_dict())
    assert runs["default"][0] == runs["adaptive"][0]
    for name, value in runs["default"][1].items():
        np.testing.assert_array_equal(value, runs["adaptive"][1][name], err_msg=name)
