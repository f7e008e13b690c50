"""The torch backend's workspace (``backends.torch.heap.plan_workspace``, session 11) and
layer norm's output recomputed in the backward (``passes.remat``).

- a LoRA BERT step writing its large results into the workspace trains bit for bit as the
  same step without it, and matches the NumPy backend;
- the generated lines of linear, matmul, gelu and layer norm nodes write into slots
  (``out=``), and the workspace keeps no graph output;
- two slots never share bytes while both buffers can be read: a slot lives until the last
  read of any view of it or any result written over it in place;
- layer norm's ``y`` that a LoRA weight gradient reads is recomputed from the layer norm's
  input (saved for its own backward anyway): fewer saved bytes, the same training bit for
  bit;
- session 20's wider op set: a LoRA LLaMA step's sigmoid, neg, concat and slice_grad
  results, and a pad and strided and plain slice gradients, take slots and train bit for
  bit as without the workspace.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import schemes, zoo
from pockengine.backends.torch import heap as torch_heap
from pockengine.backends.torch.backend import TorchBackend
from pockengine.ir import Fact, Graph, Phase, get_op
from pockengine.passes import DEFAULT_PIPELINE, rematerialize
from pockengine.plan.inplace import reusable_inputs
from pockengine.plan.liveness import last_reads
from pockengine.plan.report import analyze

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# a line writing into a slot: an ``out=`` argument, a copy, or a fill the input is copied into
SLOT_WRITE = r"((out|out0|grad_input)=k\d+)|to_slot\(k\d+|= k\d+\.(fill|zero)_\("
WITHOUT_REMAT = tuple(p for p in DEFAULT_PIPELINE if p is not rematerialize)


def _bert(layers: int = 1) -> zoo.Workload:
    return zoo.bert_classifier(layers=layers, hidden=32, heads=4, ffn=64, seq=16, batch=4,
                               vocab=64)  # fmt: skip


def _compile(backend: Any, passes: Any = None, layers: int = 1) -> pe.TrainStep:
    w = _bert(layers)
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.AdamW(lr=1e-2),
                      schemes.lora(4, 8), backend=backend, passes=passes)  # fmt: skip


def _train(step: pe.TrainStep, layers: int = 1) -> tuple[list[float], dict[str, Any]]:
    w = _bert(layers)
    losses = [step(*w.make_batch(k)) for k in range(3)]
    return losses, step.flat_state_dict()


@pytest.fixture(scope="module")
def workspace_step() -> pe.TrainStep:
    """The LoRA step with a workspace, slots down to 1 KiB (this graph's results are small)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_WORKSPACE_BYTES", 1024)
        return _compile(TorchBackend(workspace=True))


def test_workspace_trains_bit_for_bit(workspace_step: pe.TrainStep) -> None:
    losses, state = _train(workspace_step)
    plain_losses, plain = _train(_compile(TorchBackend()))
    ref_losses, ref = _train(_compile("numpy"))
    assert losses == plain_losses
    assert state.keys() == plain.keys() == ref.keys()
    for name, value in plain.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
        np.testing.assert_allclose(state[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_large_results_are_written_into_slots(workspace_step: pe.TrainStep) -> None:
    exe = workspace_step._exec
    graph, workspace = exe.graph, exe.workspace
    assert workspace is not None and workspace.offsets
    lines = exe.source.splitlines()
    made_at = {v.name: (i, v) for i, n in enumerate(graph.nodes) for v in n.outputs}
    slotted = {graph.nodes[made_at[name][0]].op for name in workspace.offsets}
    assert {"linear", "matmul", "gelu", "layer_norm"} <= slotted <= torch_heap.WORKSPACE_OPS
    for name in workspace.offsets:  # node i is on line first_line + i; slots are globals k<n>
        line = lines[exe._first_line - 1 + made_at[name][0]]
        assert re.search(SLOT_WRITE, line), line
    outputs = {v.name for v in graph.outputs}
    assert not outputs & set(workspace.offsets)
    assert workspace.nbytes <= sum(made_at[name][1].type.nbytes for name in workspace.offsets)


def _buffer_end(graph: Graph, i: int, result: int, reuse: dict[int, int]) -> int:
    """The last read of node i's result or of anything sharing its memory (test's own walk:
    views of it, in-place results over it, transitively)."""
    last = last_reads(graph)
    shared = {graph.nodes[i].outputs[result].name}
    for j, node in enumerate(graph.nodes[i + 1 :], start=i + 1):
        view = get_op(node.op).has(Fact.VIEW) and node.inputs[0].name in shared
        over = j in reuse and node.inputs[reuse[j]].name in shared
        if view or over:
            shared.add(node.outputs[0].name)
    return max(last[name] for name in shared)


def test_slots_never_overlap_while_alive(workspace_step: pe.TrainStep) -> None:
    graph = workspace_step._exec.graph
    reuse = reusable_inputs(graph)
    workspace = torch_heap.plan_workspace(graph, reuse, torch_heap.WORKSPACE_OPS, 1024)
    made_at = {v.name: (i, k) for i, n in enumerate(graph.nodes) for k, v in enumerate(n.outputs)}
    spans = []
    for name, offset in workspace.offsets.items():
        i, k = made_at[name]
        nbytes = graph.nodes[i].outputs[k].type.nbytes
        spans.append((i, _buffer_end(graph, i, k, reuse), offset, offset + nbytes))
        assert offset % 64 == 0 and offset + nbytes <= workspace.nbytes
    assert len(spans) > 10
    for a in spans:
        for b in spans:
            if a is not b and a[0] <= b[1] and b[0] <= a[1]:  # alive together
                assert a[3] <= b[2] or b[3] <= a[2], (a, b)


def test_views_keep_a_slot_alive(workspace_step: pe.TrainStep) -> None:
    """Some slot's buffer is read through a view after its own last read: the planner's
    lifetime covers it (q, k, v are read by the attention backward through transposes)."""
    graph = workspace_step._exec.graph
    reuse, last = reusable_inputs(graph), last_reads(graph)
    workspace = torch_heap.plan_workspace(graph, reuse, torch_heap.WORKSPACE_OPS, 1024)
    made_at = {v.name: (i, k) for i, n in enumerate(graph.nodes) for k, v in enumerate(n.outputs)}
    longer = [name for name in workspace.offsets
              if _buffer_end(graph, *made_at[name], reuse) > last[name]]  # fmt: skip
    assert longer


def test_layer_norm_output_recomputed_for_lora() -> None:
    """Two layers: the second layer's adapters read the first layer's output layer norm,
    whose input its backward keeps (the first's read the embeddings' layer norm, which
    gets no backward)."""
    with_remat = _compile("numpy", layers=2)
    without = _compile("numpy", passes=WITHOUT_REMAT, layers=2)
    recomputed = [n for n in with_remat.graph.nodes
                  if n.op == "layer_norm" and n.phase is Phase.BACKWARD]  # fmt: skip
    assert recomputed  # the adapters' input, made again from the saved layer norm input
    users = with_remat.graph.users()
    for n in recomputed:
        readers = users.get(n.outputs[0].name, [])
        assert readers and all(r.phase is Phase.BACKWARD for r in readers)
    saved = analyze(with_remat.graph).saved_activation_bytes
    assert saved < analyze(without.graph).saved_activation_bytes
    losses, state = _train(with_remat, layers=2)
    losses0, state0 = _train(without, layers=2)
    assert losses == losses0
    for name, value in state0.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def _llama_step(backend: Any) -> tuple[pe.TrainStep, zoo.Workload]:
    w = zoo.llama_lm(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq=8,
                     batch=2)  # fmt: skip
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.AdamW(lr=1e-2),
                      schemes.lora(4, 8), backend=backend)  # fmt: skip
    return step, w


def test_llama_elementwise_pads_and_concats_write_into_slots() -> None:
    """A LoRA LLaMA step (gated MLP, rotary embeddings, grouped-query attention): the
    sigmoid, subtract, concat (rotate-half) and slice-gradient (its backward) results take
    slots too, and the step trains bit for bit as without the workspace."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_WORKSPACE_BYTES", 256)
        step, w = _llama_step(TorchBackend(workspace=True))
    exe = step._exec
    assert exe.workspace is not None
    made_at = {v.name: n.op for n in exe.graph.nodes for v in n.outputs}
    slotted = {made_at[name] for name in exe.workspace.offsets}
    assert {"sigmoid", "concat", "slice_grad", "neg"} <= slotted <= torch_heap.WORKSPACE_OPS
    plain, _ = _llama_step(TorchBackend())
    for k in range(3):
        assert step(*w.make_batch(k)) == plain(*w.make_batch(k))
    ours, theirs = step.flat_state_dict(), plain.flat_state_dict()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


class _PadsAndStrides(torch.nn.Module):
    """A pad in the forward pass, and slices with and without a step (their gradients are
    slice_grad nodes: a pad, and a strided scatter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        padded = torch.nn.functional.pad(h[:, ::2], (3, 1), value=0.5)
        return ((padded[:, 2:18] - y) ** 2).mean()


def test_pad_and_slice_gradients_write_into_slots() -> None:
    """pad (filled, the input copied in) and slice_grad with and without a step take slots,
    and train bit for bit as without the workspace, close to NumPy."""
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy(rng.standard_normal((64, 16), dtype=np.float32)),
                torch.from_numpy(rng.standard_normal((64, 16), dtype=np.float32)))
               for _ in range(3)]  # fmt: skip

    def trained(backend: Any) -> tuple[pe.TrainStep, list[float]]:
        torch.manual_seed(0)
        step = pe.compile(_PadsAndStrides(), lambda m, x, y: m(x, y), batches[0],
                          pe.optim.SGD(lr=0.1), schemes.full(), backend=backend)  # fmt: skip
        return step, [float(step(*b)) for b in batches]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_heap, "MIN_WORKSPACE_BYTES", 256)
        step, losses = trained(TorchBackend(workspace=True))
    exe = step._exec
    assert exe.workspace is not None
    made_at = {v.name: n for n in exe.graph.nodes for v in n.outputs}
    slotted = [made_at[name] for name in exe.workspace.offsets]
    assert "pad" in {n.op for n in slotted}
    steps = {n.attrs["step"] for n in slotted if n.op == "slice_grad"}
    assert steps == {1, 2}, steps
    plain, plain_losses = trained(TorchBackend())
    reference, ref_losses = trained("numpy")
    assert losses == plain_losses
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ours, ref = step.flat_state_dict(), reference.flat_state_dict()
    for name, value in plain.flat_state_dict().items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-4, atol=1e-6, err_msg=name)
