"""Session 12: the torch workspace covers every large result of a LoRA step, and glibc's
mmap threshold can be fixed (``backends.torch.heap``).

- the results of kernels without a usable ``out=`` (flash attention and its backward,
  layer norm's input gradient) are copied into their slots in ATen's own layout
  (``torch_kernels.to_slot``), embeddings gathered straight into theirs, and training
  stays bit for bit the same as without a workspace;
- every result of those ops that a later node reads has a slot;
- ``TorchBackend(heap_thresholds=...)`` is validated, and fixing glibc's thresholds keeps
  a block mapped on its own after a larger one was freed (glibc's dynamic threshold would
  have put it in the heap).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.backends.torch import heap as torch_heap
from pockengine.backends.torch.backend import TorchBackend
from pockengine.backends.torch.kernels import to_slot
from pockengine.ir import CompileError
from pockengine.plan.liveness import last_reads
from tests import test_torch_workspace

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_OPS = ("attention", "attention_grad", "layer_norm_grad", "embedding")


def _compile(backend: Any) -> pe.TrainStep:
    return test_torch_workspace._compile(backend, layers=2)


def _train(step: pe.TrainStep) -> tuple[list[float], dict[str, Any]]:
    return test_torch_workspace._train(step, layers=2)


@pytest.fixture(scope="module")
def slotted_step() -> pe.TrainStep:
    """The two-layer LoRA step with a workspace, slots down to 512 bytes (small graph)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_WORKSPACE_BYTES", 512)
        return _compile(TorchBackend(workspace=True))


def test_every_read_result_of_the_new_ops_has_a_slot(slotted_step: pe.TrainStep) -> None:
    exe = slotted_step._exec
    graph, workspace = exe.graph, exe.workspace
    assert workspace is not None
    last, lines = last_reads(graph), exe.source.splitlines()
    seen: dict[str, int] = dict.fromkeys(NEW_OPS, 0)
    for i, node in enumerate(graph.nodes):
        if node.op not in NEW_OPS:
            continue
        wanted = (0, 1, 2) if node.op == "attention_grad" else (0,)
        for k in wanted:
            value = node.outputs[k]
            if last[value.name] > i and value.type.nbytes >= 512:
                assert value.name in workspace.offsets, (node.op, k)
                seen[node.op] += 1
        line = lines[exe._first_line - 1 + i]
        copied = node.op in torch_heap.COPIED_OPS
        assert ("to_slot(k" in line) == copied or node.op == "embedding", line
        if node.op == "embedding":
            assert "aten_index_select(" in line and "out=k" in line, line
    assert all(seen.values()), seen
    grads = [n for n in graph.nodes if n.op == "attention_grad"]
    assert any(all(v.name in workspace.offsets for v in n.outputs) for n in grads)


def test_slotted_step_trains_bit_for_bit(slotted_step: pe.TrainStep) -> None:
    losses, state = _train(slotted_step)
    plain_losses, plain = _train(_compile(TorchBackend()))
    assert losses == plain_losses
    assert state.keys() == plain.keys()
    for name, value in plain.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_to_slot_keeps_the_layout() -> None:
    """A [B, L, H, E] tensor seen as [B, H, L, E] (what ATen's flash kernels return) is
    copied with its strides, so the permute back to [B, L, H, E] stays a view."""
    made = torch.randn(2, 5, 3, 4).permute(0, 2, 1, 3)
    slot = torch.empty(made.numel())
    copied = to_slot(slot, made)
    assert copied.data_ptr() == slot.data_ptr()
    assert copied.stride() == made.stride() and torch.equal(copied, made)
    assert copied.permute(0, 2, 1, 3).is_contiguous()
    sparse_view = torch.randn(4, 6)[:, ::2]  # not dense: the slot could not hold it
    assert to_slot(torch.empty(sparse_view.numel()), sparse_view) is sparse_view


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heap_thresholds": (0, 1 << 20)}, "mmap threshold is 1 to"),
        ({"heap_thresholds": (64 << 20, 1 << 20)}, "mmap threshold is 1 to"),
        ({"heap_thresholds": (1 << 17, 0)}, "trim threshold must be positive"),
        ({"heap_thresholds": ("128K", 1 << 20)}, "numbers of bytes"),
        ({"heap_thresholds": (True, 1 << 20)}, "numbers of bytes"),
        ({"heap_thresholds": 1 << 17}, "a pair"),
        ({"heap_thresholds": (1 << 17, 1 << 20), "keep_heap": True}, "choose one"),
    ],
)
def test_heap_thresholds_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(CompileError, match=message):
        TorchBackend(**kwargs)


_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys, torch
    from pockengine.backends.torch.backend import TorchBackend
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "fixed":
        from pockengine import ir
        b = ir.GraphBuilder("g")
        x = b.input("x", ir.TensorType((2,), ir.DType.F32))
        TorchBackend(heap_thresholds=(1 << 17, 1 << 20)).compile(b.build([b.call("neg", x)]))
    big = torch.ones(16 << 18)  # 16 MiB freed: glibc's dynamic threshold rises past 1 MiB
    del big
    before = libc.mallinfo2().hblkhd
    block = torch.ones(1 << 18)  # 1 MiB
    print(json.dumps(libc.mallinfo2().hblkhd - before))
    """
)


def _mapped_bytes(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def test_fixed_mmap_threshold_maps_a_block_after_a_larger_one_was_freed() -> None:
    assert _mapped_bytes("dynamic") == 0  # the 1 MiB block came from the heap
    assert _mapped_bytes("fixed") >= 1 << 20  # mapped on its own, unmapped at its free
