"""The C backend's elementwise-chain fusion (backends/c/fuse_ew.py, ops/ew_chain.py): a
SwiGLU MLP with RMSNorm trains bit for bit as the unfused C step does and as the NumPy
step does within float32 rounding; the graph C runs and plans holds no intermediate of a
chain; a chain never reads a value past a parameter update that wrote it."""

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
from pockengine.backends.c import CBackend, backend, lowering
from pockengine.backends.c.fuse_ew import fuse_elementwise_chains
from pockengine.ir import get_op, parse_graph, verify
from tests.cached_cc import make_trainer
from tests.test_c_trainer_mmap import SANITIZE

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


class _SwiGLU(nn.Module):
    """RMSNorm, then LLaMA's gated MLP ``down(silu(gate(x)) * up(x))``, with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16, eps=1e-6)
        self.gate, self.up = nn.Linear(16, 40, bias=False), nn.Linear(16, 40, bias=False)
        self.down, self.head = nn.Linear(40, 16, bias=False), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return self.head(h)


def _compile(c: bool) -> Any:
    torch.manual_seed(0)
    model, x, y = _SwiGLU(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    return pe.compile(
        model,
        lambda m, x, y: nn.functional.cross_entropy(m(x), y),
        (x, y),
        optimizer=pe.optim.AdamW(lr=1e-2),
        backend=CBackend() if c else "numpy",
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g))] * 4


@pytest.fixture(scope="module")
def fused() -> Any:
    return _compile(c=True)


@pytest.fixture(scope="module")
def unfused() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        passes = tuple(p for p in lowering.LOWERING_PASSES if p is not fuse_elementwise_chains)
        mp.setattr(lowering, "LOWERING_PASSES", passes)
        mp.setattr(backend, "LOWERING_PASSES", passes)
        return _compile(c=True)


def test_the_c_graph_computes_each_chain_in_one_node(fused: Any, unfused: Any) -> None:
    before = Counter(n.op for n in unfused._exec.graph.nodes)
    after = Counter(n.op for n in fused._exec.graph.nodes)
    assert before["elementwise_chain"] == 0 and after["elementwise_chain"] >= 3
    assert after["mul"] < before["mul"] and after["sigmoid"] < before["sigmoid"]
    # the gate's gradient, silu's derivative times the up projection's, is one chain
    steps = [n.attrs["ops"] for n in fused._exec.graph.nodes if n.op == "elementwise_chain"]
    assert ("mul", "mul", "mul", "sub", "mul", "mul", "add") in steps
    assert sum(after.values()) < sum(before.values())
    verify(fused._exec.graph)
    # no intermediate of a chain has a result, so none has a place in the arena
    made = {v.name for n in fused._exec.graph.nodes for v in n.outputs}
    gone = {v.name for n in unfused._exec.graph.nodes for v in n.outputs} - made
    assert gone and not gone & set(fused._exec.plan.offsets)
    assert fuse_elementwise_chains(fused._exec.graph) is fused._exec.graph


def test_fused_training_is_bit_identical_to_unfused_and_follows_numpy(
    fused: Any, unfused: Any
) -> None:
    ref = _compile(c=False)
    for batch in _batches():
        got, same, want = fused(*batch), unfused(*batch), ref(*batch)
        assert got == same
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for name, value in unfused.state_dict().items():
        np.testing.assert_array_equal(fused.state_dict()[name], value, err_msg=name)
        np.testing.assert_allclose(value, ref.state_dict()[name], rtol=1e-4, atol=1e-5)


UPDATED_BETWEEN = """
graph train_step(x: f32[4] input, w: f32[4] param, lr: f32[] state) {
  %a: f32[4] = mul(x, w)
  %s: f32[4] = sigmoid(%a)
  %loss: f32[] = sum(%s, axes=None, keepdims=False)
  ! sgd_update(w, %s, lr, weight_decay=0.0)
  %n: f32[4] = neg(%s)
  %z: f32[4] = add(%n, x)
  return %loss, %z
}
"""


def test_a_chain_reads_no_value_past_its_update() -> None:
    """``%s`` has two readers and stays; ``%a * w`` is folded into the sigmoid (both read
    before w's update); ``neg`` and ``add`` after the update fold into one chain that reads
    ``%s``, never ``w``."""
    graph = parse_graph(UPDATED_BETWEEN)
    fused = fuse_elementwise_chains(graph)
    verify(fused)
    ops = [n.op for n in fused.nodes]
    assert ops == ["elementwise_chain", "sum", "sgd_update", "elementwise_chain"]
    first, last = fused.nodes[0], fused.nodes[-1]
    assert first.attrs["ops"] == ("mul", "sigmoid") and last.attrs["ops"] == ("neg", "add")
    assert [v.name for v in last.inputs] == ["s", "x"]
    feeds = {"x": np.arange(4, dtype=np.float32) - 1.5, "w": np.full(4, 0.5, np.float32)}
    s = get_op("sigmoid").kernel(feeds["x"] * feeds["w"])
    chain = get_op("elementwise_chain").kernel(s, feeds["x"], **dict(last.attrs))
    np.testing.assert_array_equal(chain, feeds["x"] - s)


UPDATE_INSIDE = """
graph train_step(x: f32[4] input, w: f32[4] param, lr: f32[] state) {
  %a: f32[4] = mul(x, w)
  %loss: f32[] = sum(x, axes=None, keepdims=False)
  ! sgd_update(w, x, lr, weight_decay=0.0)
  %z: f32[4] = neg(%a)
  return %loss, %z
}
"""


def test_a_read_before_an_update_is_not_moved_past_it() -> None:
    graph = parse_graph(UPDATE_INSIDE)
    assert fuse_elementwise_chains(graph) is graph


def test_the_exported_trainer_runs_the_chains_under_the_sanitizers(tmp_path: Path) -> None:
    """The step exported to C, built with AddressSanitizer and UBSan: its chains' loops
    (in place over a dying input where the plan says so) train as the compiled step does,
    with no sanitizer report."""
    step = _compile(c=False)
    folder = step.export(tmp_path / "trainer", target="c")
    assert "elementwise_chain(" in (folder / "step.c").read_text()
    batches = _batches()[:2]
    np.save(folder / "X.npy", np.stack([b[0].numpy() for b in batches]))
    np.save(folder / "Y.npy", np.stack([b[1].numpy() for b in batches]))
    # test_c_trainer_mmap's flags (the kernels' objects are shared); a UBSan report, which
    # does not stop the run, fails the assert on stderr below
    make_trainer(folder, f"CFLAGS=-O1 -g {SANITIZE}", f"LDFLAGS={SANITIZE}")
    run = subprocess.run(["./train", "X.npy", "Y.npy"], cwd=folder, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert "runtime error" not in run.stderr and "Sanitizer" not in run.stderr
    losses = [float(ln.split()[-1]) for ln in run.stdout.splitlines() if ln.startswith("step ")]
    np.testing.assert_allclose(losses, [step(*b) for b in batches], rtol=1e-5)
