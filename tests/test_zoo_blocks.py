"""Learned positions, top-k routing and F.fold (pockengine/zoo_blocks.py, batch_checks.py).

- A GPT-2-style LM whose positions are ``wpe(arange(t))`` and a Hugging Face-style
  classifier that looks its positions up the same way compile (the walk from each gather
  index back to the batch crashed on ``arange``, a node without inputs) and match
  torch.autograd; a constant index is checked once, at compile time, and is no batch input.
- A mixture-of-experts block (``topk`` router) and a mobile-ViT-style unfold/fold model
  (``index_put`` with accumulation; overlapping windows and MobileViT's plain patches)
  match torch.autograd; these and the GPT-2 model train as torch.optim does (SGD with
  momentum, equal params after the steps) on the NumPy, torch and C backends.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine.ir import CompileError, DType, GraphBuilder, Role, TensorType
from pockengine.plan.index_bounds import index_bounds
from pockengine.step.running import BatchError
from pockengine.zoo import Workload
from pockengine.zoo_blocks import fold_vit, gpt2_lm, moe_classifier
from tests.torch_ref import assert_gradients_match, assert_training_matches

_BACKENDS = ["numpy", "torch", "c"]


# -- positions from arange ---------------------------------------------------------------------


class _PositionsClassifier(nn.Module):
    """A Hugging Face-style encoder classifier: word + position embeddings (positions
    looked up with ``arange`` sliced from a longer table), layer norm, one encoder layer,
    the first token's state to a head."""

    def __init__(self, vocab: int = 40, positions: int = 16, hidden: int = 16) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position = nn.Embedding(positions, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        h = self.norm(self.word(ids) + self.position(positions))
        logits: torch.Tensor = self.head(self.layer(h)[:, 0])
        return logits


def _positions_classifier(seq: int = 8) -> Workload:
    torch.manual_seed(0)

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1, 40, (3, seq), generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(m: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids), y)

    return Workload("positions", _PositionsClassifier(), loss, make)


def test_gpt2_learned_positions_and_tied_head_match_autograd() -> None:
    step = assert_gradients_match(gpt2_lm())
    # the token ids are checked at the batch boundary; the positions are no batch input
    bounds = {(b.input, b.high, b.what) for b in step.facts.index_bounds}
    assert bounds == {("batch.0", 64, "token id"), ("batch.0", 64, "class target")}
    with pytest.raises(BatchError, match=r"token id 64 at position \(1, 3\)"):
        ids = gpt2_lm().make_batch(0)[0].clone()
        ids[1, 3] = 64
        step(ids)


def test_classifier_with_positions_from_arange_matches_autograd() -> None:
    assert_gradients_match(_positions_classifier())


def test_a_constant_index_out_of_range_is_a_compile_error_naming_the_node() -> None:
    # 12 positions looked up in a table of 8: torch.export traces it; the compile refuses
    w = _positions_classifier(seq=12)
    w.model.position = nn.Embedding(8, 16)
    with pytest.raises(
        CompileError, match=r"embedding at position: .*holding 8 .*outside \[0, 8\)"
    ):
        pe.compile(w.model, w.loss_fn, w.make_batch(0), compile_in="process")


def _embedding_graph(index_from: str) -> Any:
    b = GraphBuilder("g")
    table = b.input("table", TensorType((5, 3), DType.F32), Role.PARAM, trainable=True)
    if index_from == "arange":
        index = b.call("arange", start=0, stop=4, step=1, dtype="i64")
    else:
        index = b.input("pos", TensorType((4,), DType.I64), Role.CONST)
    out = b.call("embedding", table, index, padding_idx=None, source="wpe")
    return b.build([b.call("sum", out, axes=None, keepdims=False)])


def test_index_bounds_follows_a_long_constant_chain_past_effects() -> None:
    """Positions made by 3000 nodes from ``arange``, a buffer update (an effect, no results)
    in the same graph: evaluated without recursion, and checked."""
    b = GraphBuilder("g")
    table = b.input("table", TensorType((5, 3), DType.F32), Role.PARAM, trainable=True)
    stat = b.input("stat", TensorType((3,), DType.F32), Role.BUFFER)
    index = b.call("arange", start=0, stop=4, step=1, dtype="i64")
    for _ in range(3000):
        index = b.call("add", index, b.call("full", shape=(), value=0, dtype="i64"))
    shifted = b.call("add", index, b.call("full", shape=(), value=2, dtype="i64"))
    out = b.call("embedding", table, shifted, padding_idx=None, source="wpe")
    b.effect("assign", stat, b.call("sum", out, axes=(0,), keepdims=False))
    graph = b.build([b.call("sum", out, axes=None, keepdims=False)])
    with pytest.raises(CompileError, match=r"embedding at wpe: .*holding 5 at position \(3,\)"):
        index_bounds(graph)


@pytest.mark.parametrize("index_from", ["arange", "const"])
def test_index_bounds_checks_a_constant_index_at_compile_time(index_from: str) -> None:
    graph = _embedding_graph(index_from)
    values = {"pos": np.arange(4)}
    assert index_bounds(graph, values) == ()  # in range, and no batch input to check
    if index_from == "const":
        assert index_bounds(graph) == ()  # values unknown: nothing to check
        with pytest.raises(CompileError, match=r"embedding at wpe: .*holding 7 at position \(2,\)"):
            index_bounds(graph, {"pos": np.array([0, 1, 7, 2])})


# -- top-k routing and F.fold --------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [moe_classifier, fold_vit, lambda: fold_vit(stride=2)],
    ids=["moe", "fold-overlapping", "fold-patches"],
)
def test_topk_and_fold_models_match_autograd(build: Any) -> None:
    assert_gradients_match(build())


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize(
    "build",
    [lambda: gpt2_lm(layers=1, seq=8), moe_classifier, fold_vit],
    ids=["gpt2", "moe", "fold"],
)
def test_models_train_as_torch_optim(build: Any, backend: str) -> None:
    optimizer = pe.optim.SGD(lr=0.1, momentum=0.9)
    reference = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    assert_training_matches(build(), optimizer, reference, steps=3, backend=backend)


def test_index_put_without_accumulate_is_refused_by_name() -> None:
    class Assign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w.index_put((torch.tensor([0, 2]),), x).sum()

    with pytest.raises(CompileError, match="index_put without accumulate=True"):
        pe.compile(Assign(), lambda m, x: m(x), (torch.randn(2, 2),), compile_in="process")


def test_index_put_accumulate_and_index_add_match_autograd() -> None:
    """``index_put_(..., accumulate=True)`` and ``index_add`` (which decomposes to it), with a
    repeated position, on a batch index: both sum into the same row."""

    class Scatter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(5, 4)
            z.index_put_((ids,), self.w, accumulate=True)
            z = z.index_add(0, ids, self.w * 2)
            return (z * z).sum()

    torch.manual_seed(0)
    work = Workload(
        "scatter", Scatter(), lambda m, ids: m(ids), lambda seed: (torch.tensor([0, 3, 0]),)
    )
    for backend in _BACKENDS:
        assert_gradients_match(work, backend=backend)


@pytest.mark.slow  # a build of the whole trainer; select.c itself runs in the tests above
def test_exported_c_trainer_runs_a_top_k_router(tmp_path: Path) -> None:
    """The stand-alone trainer builds with kernels/select.c and trains as the step does."""
    w = moe_classifier()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.1),
                      backend="c")  # fmt: skip
    folder = step.export(tmp_path / "trainer", target="c")
    batches = [w.make_batch(i) for i in range(2)]
    np.save(folder / "X.npy", np.stack([b[0].numpy() for b in batches]))
    np.save(folder / "Y.npy", np.stack([b[1].numpy() for b in batches]))
    losses = [step(*b) for b in batches]
    subprocess.run(["make", "-s", "-C", str(folder), "CFLAGS=-O0"], check=True)  # a quick build
    run = subprocess.run(["./train", "X.npy", "Y.npy"], cwd=folder, capture_output=True,
                         text=True, check=True)  # fmt: skip
    got = [float(ln.split()[-1]) for ln in run.stdout.splitlines() if ln.startswith("step ")]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
