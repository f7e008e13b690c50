"""The C backend's batch norm + hardtanh fusion (backends/c/fuse_bn.py): the graph the C
step runs and plans holds no normalised tensor and no masked gradient, and training on
it matches the NumPy backend over 5 steps."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend
from pockengine.backends.c.fuse_bn import fuse_batch_norm_hardtanh
from pockengine.backends.c.fuse_ew import fuse_elementwise_chains
from pockengine.backends.c.fuse_transpose import transpose_products
from pockengine.ir import Graph, verify
from pockengine.plan import plan_memory
from tests.cached_cc import make_trainer

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _block_net() -> zoo.Workload:
    """A stem conv-bn-relu6, one expanding inverted residual (pointwise, depthwise, linear
    projection, skip) and a classifier: every batch-norm pattern of MobileNetV2."""
    torch.manual_seed(0)
    model = nn.Sequential(
        zoo.ConvBNReLU(3, 8, 3, stride=2),
        zoo.InvertedResidual(8, 8, stride=1, expand=3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((4, 3, 12, 12), generator=g), torch.randint(0, 5, (4,), generator=g)

    return zoo.as_double(zoo.Workload("blocks", model, zoo._classify, make))


def _sgd() -> pe.optim.Optimizer:
    return pe.optim.SGD(lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def steps() -> tuple[Any, Any, zoo.Workload]:
    w = _block_net()
    batch = w.make_batch(0)
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd())
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd(), backend=CBackend())
    return ref, ours, w


def _ops(graph: Graph) -> Counter[str]:
    return Counter(node.op for node in graph.nodes)


def test_the_fused_graph_stores_no_normalised_tensor(steps: Any) -> None:
    ref, ours, _ = steps
    unfused, ex = ref.graph, ours._exec
    before, after = _ops(unfused), _ops(ex.graph)
    # three conv-bn-relu6, each also rematerialised in the backward for its weight gradient
    assert before["hardtanh"] == 6 and before["hardtanh_grad"] == 3
    assert after["hardtanh"] == after["hardtanh_grad"] == 0
    assert after["batch_norm_hardtanh"] == 3 and after["batch_norm_hardtanh_grad"] == 3
    # the rematerialised three read the forward's statistics
    assert after["batch_norm_apply"] == 3
    assert after["batch_norm"] == 1 and after["batch_norm_grad"] == 1  # the projection's
    verify(ex.graph)
    # the plan is the fused graph's: neither a normalised tensor that a hardtanh read nor a
    # masked gradient has a place in the arena
    clipped = {n.inputs[0].name for n in unfused.nodes if n.op == "hardtanh"}
    masked = {n.outputs[0].name for n in unfused.nodes if n.op == "hardtanh_grad"}
    made = {v.name for n in ex.graph.nodes for v in n.outputs}
    assert clipped and masked and not (clipped | masked) & (made | set(ex.plan.offsets))
    assert plan_memory(ex.graph).arena_bytes == ex.plan.arena_bytes


def test_the_rewrite_is_the_pipeline_s_last_c_pass(steps: Any) -> None:
    """Rewriting the NumPy step's graph, then the C passes after it (transposed products,
    elementwise chains), gives the graph the C step runs (rewriting it again changes
    nothing)."""
    ref, ours, _ = steps
    fused = fuse_batch_norm_hardtanh(ref.graph)
    lowered = fuse_elementwise_chains(transpose_products(fused))
    assert [n.op for n in lowered.nodes] == [n.op for n in ours._exec.graph.nodes]
    assert fuse_batch_norm_hardtanh(fused) is fused


def _trains_as_numpy(ref: Any, ours: Any, w: zoo.Workload) -> None:
    """Five steps of ``ours`` give ``ref``'s losses and leave its state (float64)."""
    for i in range(5):
        batch = w.make_batch(i)
        want, got = ref(*batch), ours(*batch)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (i, got, want)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[name], value, rtol=1e-8, atol=1e-10)


def test_fused_training_matches_numpy(steps: Any) -> None:
    _trains_as_numpy(*steps)


def test_the_exported_trainer_runs_the_fused_graph(tmp_path: Path) -> None:
    """A step compiled on NumPy, exported to C: the trainer's step calls the fused kernels
    and trains as the NumPy step does."""
    w = _block_net()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=_sgd())
    folder = step.export(tmp_path / "trainer", target="c")
    source = (folder / "step.c").read_text()
    assert "pe_batch_norm_hardtanh_grad_f64(" in source and "pe_hardtanh_grad" not in source
    batches = [w.make_batch(i) for i in range(2)]
    np.save(folder / "X.npy", np.stack([b[0].numpy() for b in batches]))
    np.save(folder / "Y.npy", np.stack([b[1].numpy() for b in batches]))
    make_trainer(folder)
    run = subprocess.run(["./train", "X.npy", "Y.npy"], cwd=folder, capture_output=True,
                         text=True, check=True)  # fmt: skip
    losses = [float(ln.split()[-1]) for ln in run.stdout.splitlines() if ln.startswith("step ")]
    np.testing.assert_allclose(losses, [step(*b) for b in batches], rtol=1e-6)


def test_an_unread_batch_norm_input_gradient_is_not_computed() -> None:
    """Bias-only training of the block net: the stem convolution (no bias) takes no
    gradient, so nothing reads its batch norm's input gradient and the C step passes that
    kernel no gx; the biases and the running statistics still train as on the NumPy
    backend over 5 steps."""
    w = _block_net()
    batch, scheme = w.make_batch(0), pe.schemes.bias_only()
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd(), scheme=scheme)
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=_sgd(), scheme=scheme,
                      backend=CBackend())  # fmt: skip
    calls = [line for line in ours._exec.source.splitlines()
             if "pe_batch_norm_hardtanh_grad_f64(" in line]  # fmt: skip
    assert len(calls) == 3 and sum(", NULL, " in line for line in calls) == 1, calls
    _trains_as_numpy(ref, ours, w)
