"""The torch backend's large slots: results above glibc's mmap ceiling that the step heap
cannot keep (``backends.torch.heap.LARGE_SLOT_BYTES``) get workspace slots by default.

- by default, a fused loss head's weight gradient of at least 32 MiB (the LLaMA
  benchmark's lm_head gradient is 62.5 MiB) gets a slot, and smaller results do not;
  ``large_slots=False`` and the opt-in heap options that turn the step heap off give none;
- the fused loss head's kernels write gx, gw and gb into their slots (both kernels, both
  weight layouts, every choice of wanted gradients), bit for bit what they compute
  without slots, and match the NumPy backend;
- in a fresh process, a steady run of a graph whose loss head makes a 36 MiB weight
  gradient takes almost no page faults by default, where without the slot glibc maps it
  afresh (a fault per page) at every run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pockengine import ir
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch import backend as torch_backend
from pockengine.backends.torch import heap as torch_heap
from pockengine.backends.torch.backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
F32 = ir.DType.F32


def loss_head_graph(
    rows: int, hidden: int, vocab: int, *, chunk: int = 8, vocab_major: bool = True,
    wanted: tuple[bool, bool, bool] = (True, True, True), whole: bool = True,
) -> ir.Graph:  # fmt: skip
    """A fused loss head's forward, its gradient kernel and the one-pass kernel on the same
    rows; the gradients of each kernel are read right after it by a ``concat`` with
    themselves (``whole``) or a ``sum``, which is returned (so a gradient is not an output,
    nor written over in place, and may get a slot; the two kernels' need not overlap)."""
    b = ir.GraphBuilder("head")
    t = ir.TensorType
    gp, scale = b.input("gp", t((rows,), F32)), b.input("scale", t((rows,), F32))
    x = b.input("x", t((rows, hidden), F32))
    w = b.input("w", t((vocab, hidden) if vocab_major else (hidden, vocab), F32))
    index = b.input("index", t((rows,), ir.DType.I64))
    bias = b.input("b", t((vocab,), F32))
    attrs = {"chunk": chunk, "vocab_major": vocab_major}
    grads = dict(zip(("x_grad", "w_grad", "b_grad"), wanted, strict=True))

    def read(g: ir.Value) -> ir.Value:
        if whole:
            return b.call("concat", g, g, axis=0)
        return b.call("sum", g, axes=None, keepdims=False)

    picked, lse = b.call_multi("linear_log_softmax_gather", x, w, index, bias, **attrs)
    back = b.call_multi("linear_log_softmax_gather_grad", gp, scale, x, w, index, lse, bias,
                        **attrs, **grads)  # fmt: skip
    outputs = [picked, lse, *(read(g) for g in back)]
    both = b.call_multi("linear_log_softmax_gather_with_grad", gp, scale, x, w, index, bias,
                        **attrs, **grads)  # fmt: skip
    return b.build([*outputs, *both[:2], *(read(g) for g in both[2:])])


def _feeds(graph: ir.Graph, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        if v.dtype == ir.DType.I64:
            vocab = graph.inputs[-1].shape[0]
            feeds[v.name] = rng.integers(0, vocab, v.shape)
        else:
            feeds[v.name] = rng.standard_normal(v.shape).astype(np.float32)
    return feeds


def _run(backend: Any, graph: ir.Graph, feeds: dict[str, Any]) -> list[np.ndarray[Any, Any]]:
    exe = backend.compile(graph)
    if isinstance(backend, TorchBackend):
        out = exe.run({}, {k: torch.from_numpy(v) for k, v in feeds.items()})
        return [backend.to_numpy(r) for r in out]
    return [np.asarray(r) for r in exe.run({}, feeds)]


def _gradients(graph: ir.Graph) -> set[str]:
    """The names of the gradients the loss head's two gradient kernels make."""
    return {v.name for n in graph.nodes if n.op.endswith("_grad") for v in n.outputs[-3:]
            if v.type.rank > 0 and v.shape != (graph.inputs[0].shape[0],)}  # fmt: skip


def test_only_results_above_the_mmap_ceiling_get_a_default_slot() -> None:
    # gw: 36 MiB (above the ceiling); gx and gb: a few KiB
    graph = loss_head_graph(rows=4, hidden=72, vocab=131072, whole=False)
    big = {v.name for n in graph.nodes for v in n.outputs if v.type.nbytes >= 32 << 20}
    assert torch_heap.LARGE_SLOT_BYTES == torch_heap.MMAP_THRESHOLD_MAX
    exe = TorchBackend().compile(graph)
    assert exe.workspace is not None
    assert len(big) == 2 and set(exe.workspace.offsets) == big  # both kernels' gw
    # one after the other: both in the same bytes
    assert exe.workspace.nbytes == max(v.type.nbytes for n in graph.nodes for v in n.outputs)
    for kwargs in ({"large_slots": False}, {"step_heap": False}, {"trim_heap": True}):
        assert TorchBackend(**kwargs).compile(graph).workspace is None, kwargs


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("wanted", [(True, True, True), (False, True, False), (True, False, True)])
def test_the_loss_head_writes_its_slots_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, vocab_major: bool, wanted: tuple[bool, bool, bool]
) -> None:
    graph = loss_head_graph(rows=21, hidden=6, vocab=40, vocab_major=vocab_major, wanted=wanted)
    feeds = _feeds(graph)
    plain = _run(TorchBackend(large_slots=False), graph, feeds)
    monkeypatch.setattr(torch_backend, "LARGE_SLOT_BYTES", 16)  # every gradient gets a slot
    slotted = TorchBackend()
    exe = slotted.compile(graph)
    assert exe.workspace is not None and set(exe.workspace.offsets) == _gradients(graph)
    # both gradient kernels are handed their slots (the tuple of gx, gw, gb's)
    assert (
        len(
            re.findall(
                r"gather_(?:with_)?grad\(.*\(((?:None|k\d+), ){2}(None|k\d+)\)\)", exe.source
            )
        )
        == 2
    )
    for _ in range(2):  # the second run overwrites the slots the first one filled
        out = _run(slotted, graph, feeds)
        for got, expected in zip(out, plain, strict=True):
            np.testing.assert_array_equal(got, expected)
    reference = _run(NumpyBackend(), graph, feeds)
    for got, expected in zip(out, reference, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_loss_head_without_rows_gives_zero_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "LARGE_SLOT_BYTES", 16)
    graph = loss_head_graph(rows=0, hidden=6, vocab=40)
    feeds = _feeds(graph)
    for backend in (TorchBackend(), TorchBackend(large_slots=False)):
        _run(backend, graph, {**feeds, "w": feeds["w"] + 1})  # a first run fills the slots
        out = _run(backend, graph, feeds)
        for got, expected in zip(out, _run(NumpyBackend(), graph, feeds), strict=True):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("padding_idx", [None, 3, -2])
def test_an_embedding_gradient_fills_its_slot(
    monkeypatch: pytest.MonkeyPatch, padding_idx: int | None
) -> None:
    b = ir.GraphBuilder("table")
    gz = b.input("gz", ir.TensorType((4, 6, 5), F32))
    ids = b.input("ids", ir.TensorType((4, 6), ir.DType.I64))
    gw = b.call("embedding_grad", gz, ids, num_rows=9, padding_idx=padding_idx)
    graph = b.build([b.call("concat", gw, gw, axis=0)])
    rng = np.random.default_rng(1)
    feeds = {
        "gz": rng.standard_normal((4, 6, 5)).astype(np.float32),
        "ids": rng.integers(-9, 9, (4, 6)),
    }  # repeated rows, negative ids, the padding row
    plain = _run(TorchBackend(), graph, feeds)
    monkeypatch.setattr(torch_backend, "LARGE_SLOT_BYTES", 16)
    slotted = TorchBackend()
    exe = slotted.compile(graph)
    assert exe.workspace is not None and set(exe.workspace.offsets) == {gw.name}
    reference = _run(NumpyBackend(), graph, feeds)
    for seed in (2, 1):  # a run over another batch first: the slot is zeroed, not added to
        other = {**feeds, "gz": np.random.default_rng(seed).standard_normal((4, 6, 5))}
        (out,) = _run(slotted, graph, {**feeds, **{"gz": other["gz"].astype(np.float32)}})
    np.testing.assert_allclose(out, plain[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, reference[0], rtol=1e-6, atol=1e-6)


_PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_torch_large_slots import _feeds, loss_head_graph
    from pockengine.backends.torch.backend import TorchBackend
    torch.set_num_threads(1)
    graph = loss_head_graph(rows=16, hidden=72, vocab=131072, chunk=16, whole=False)
    feed = {k: torch.from_numpy(v) for k, v in _feeds(graph).items()}
    faults = {}
    backends = (("control", TorchBackend(large_slots=False)), ("default", TorchBackend()))
    for kind, backend in backends:
        run, out = backend.compile(graph), []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            run.run({}, feed)
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        faults[kind] = out
        del run
    print(json.dumps(faults))
    """
)


def _faults_per_run() -> dict[str, list[int]]:
    """Minor page faults of each of five runs of the loss head graph without its large
    slots (control) and with them (default), one after the other in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", _PROBE, str(ROOT / "tests")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    faults: dict[str, list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return faults


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's heap and getrusage: Linux")
def test_a_steady_run_maps_no_large_gradient_afresh() -> None:
    faults = _faults_per_run()
    control, default = faults["control"], faults["default"]
    pages = 2 * 131072 * 72 * 4 // 4096  # the two 36 MiB weight gradients, a run
    # runs 3-5: without slots, each gradient is mapped on its own and faulted in page by page
    assert min(control[2:]) > pages // 2, control
    # with slots, no gradient is mapped afresh: a run faults in less than half of one
    # gradient's pages (the rest of the heap may still grow by a few MiB early on)
    assert max(default[2:]) < pages // 4, default
