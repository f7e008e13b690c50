"""Batch inputs used as advanced indices (``pockengine.plan.index_bounds``).

``table[ids]`` (the IR's ``index``) and ``x.index_put((ids,), v, accumulate=True)`` /
``x.index_add(0, ids, v)`` (``index_put_add``) with ``ids`` a batch input: a value outside
``[-n, n)`` for an axis of size n is a ``BatchError`` naming the batch entry, position and
value on the NumPy, torch and C backends, before anything trains; a negative value inside
counts from the end and trains as torch does. The exported ``./train`` (built with
AddressSanitizer and UBSan) refuses such a batch file with exit 2, every file unchanged;
``index_put_add``'s C loop skips an out-of-range index when called directly; a constant
index out of range is a compile error; a step artifact without the bounds' ``low`` loads.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine.backends.c import CBackend
from pockengine.ir import CompileError, DType, GraphBuilder, Role, TensorType
from pockengine.plan.index_bounds import IndexBound, index_bounds
from pockengine.step.artifact import load_step
from pockengine.step.compiler import BatchError
from tests.cached_cc import make_trainer
from tests.test_c_trainer_hostile import SANITIZE, _losses, _snapshot, _train
from tests.test_c_trainer_hostile import pytestmark as needs_cc

Array = np.ndarray[Any, Any]
ROWS, SLOTS, WIDTH = 7, 5, 3


class _Indexing(nn.Module):
    """``table[ids]`` into a linear layer, summed into ``base`` at ``pos`` by ``kind``:
    ``index_put`` (accumulate=True) or ``index_add``; ``kind="index"`` returns the rows."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.table = nn.Parameter(torch.randn(ROWS, WIDTH))
        self.base = nn.Parameter(torch.randn(SLOTS, WIDTH))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.lin(self.table[ids])
        if self.kind == "index":
            return rows
        if self.kind == "index_add":
            return self.base.index_add(0, pos, rows)
        return self.base.index_put((pos,), rows, accumulate=True)


def _loss(m: nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = ((m(ids, pos) - 1.0) ** 2).mean()
    return loss


IDS = np.array([0, 6, -1, -7, 3, 2], np.int64)  # negative ids count from the end
POS = np.array([4, -5, 0, -1, 4, 2], np.int64)  # repeated positions are summed


def _batch(ids: Array = IDS, pos: Array = POS) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(ids), torch.from_numpy(pos)


def _with(array: Array, at: int, value: int) -> Array:
    out = array.copy()
    out[at] = value
    return out


def _state(step: Any) -> dict[str, Array]:
    return {**step.flat_state_dict(), **step.optimizer_state()}


def _compile(kind: str, backend: str) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    model = _Indexing(kind)
    reference = copy.deepcopy(model)
    step = pe.compile(model, _loss, _batch(), backend=backend, optimizer=pe.optim.SGD(lr=0.1))
    return step, reference


BAD = [
    (0, _with(IDS, 1, ROWS), f"batch entry 0: index {ROWS} at position 1 is outside [-7, 7)"),
    (0, _with(IDS, 3, -ROWS - 1), "batch entry 0: index -8 at position 3 is outside [-7, 7)"),
    (1, _with(POS, 5, SLOTS), "batch entry 1: index 5 at position 5 is outside [-5, 5)"),
    (1, _with(POS, 0, -(10**6)), "batch entry 1: index -1000000 at position 0 is outside [-5, 5)"),
]  # fmt: skip


def _backends() -> list[Any]:
    return ["numpy", "torch", pytest.param("c", marks=needs_cc)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["index", "index_put", "index_add"])
def test_out_of_range_indices_are_batch_errors_and_negative_ones_train_as_torch(
    kind: str, backend: str
) -> None:
    step, reference = _compile(kind, backend)
    bounds = set(step.facts.index_bounds)
    assert IndexBound("batch.0", ROWS, frozenset(), "index", -ROWS) in bounds
    if kind != "index":
        assert IndexBound("batch.1", SLOTS, frozenset(), "index", -SLOTS) in bounds
    before = _state(step)
    for entry, bad, message in BAD:
        if kind == "index" and entry == 1:
            continue  # the rows alone: pos indexes nothing
        batch = (bad, POS) if entry == 0 else (IDS, bad)
        with pytest.raises(BatchError) as info:
            step(*_batch(*batch))
        assert message in str(info.value) and "nothing was trained" in str(info.value)
        for name, value in _state(step).items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
    # eager index_add refuses a negative index; torch.export decomposes it to index_put,
    # which counts it from the end, as the compiled step does
    wrapped = _batch(IDS, POS % SLOTS if kind == "index_add" else POS)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        want = _loss(reference, *wrapped)
        want.backward()
        opt.step()
        assert step(*_batch()) == pytest.approx(want.item(), rel=1e-5)
    ours = step.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


class _Grid(nn.Module):
    """Two batch indices on two axes of different sizes: ``grid[rows, cols]``."""

    def __init__(self) -> None:
        super().__init__()
        self.grid = nn.Parameter(torch.randn(4, 6, 2))

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.grid[rows, cols]


def test_each_index_is_bounded_by_its_own_axis() -> None:
    rows, cols = torch.tensor([[0, -4], [3, 1]]), torch.tensor([[5, -6], [0, 2]])
    step = pe.compile(_Grid(), lambda m, r, c: m(r, c).sum(), (rows, cols))
    assert set(step.facts.index_bounds) == {
        IndexBound("batch.0", 4, frozenset(), "index", -4),
        IndexBound("batch.1", 6, frozenset(), "index", -6),
    }
    with pytest.raises(BatchError, match=r"batch entry 0: index 4 at position \(1, 0\) is out"):
        step(torch.tensor([[0, 1], [4, 1]]), cols)
    with pytest.raises(BatchError, match=r"batch entry 1: index -7 at position \(0, 1\) is out"):
        step(rows, torch.tensor([[5, -7], [0, 2]]))


def _constant_index_graph(kind: str) -> Any:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((5, 3), DType.F32), Role.PARAM, trainable=True)
    pos = b.input("pos", TensorType((4,), DType.I64), Role.CONST)
    if kind == "index":
        out = b.call("index", x, pos, axes=(0,), source="rows")
    else:
        values = b.call("full", shape=(4, 3), value=1.0, dtype="f32")
        out = b.call("index_put_add", x, values, pos, axes=(0,), source="rows")
    return b.build([b.call("sum", out, axes=None, keepdims=False)])


@pytest.mark.parametrize("kind", ["index", "index_put_add"])
def test_a_constant_index_is_checked_at_compile_time(kind: str) -> None:
    graph = _constant_index_graph(kind)
    assert index_bounds(graph, {"pos": np.array([0, -5, 4, -1])}) == ()  # in range
    with pytest.raises(CompileError, match=rf"{kind} at rows: .*holding -6 .*outside \[-5, 5\)"):
        index_bounds(graph, {"pos": np.array([0, 1, -6, 2])})


@needs_cc
def test_the_c_index_put_add_loop_never_writes_outside_its_result() -> None:
    """Called directly (no batch check): an index outside the axis adds nothing."""
    b = GraphBuilder("g")
    x = b.input("x", TensorType((4, 3), DType.F32), Role.INPUT)
    values = b.input("values", TensorType((5, 3), DType.F32), Role.INPUT)
    ids = b.input("ids", TensorType((5,), DType.I64), Role.INPUT)
    graph = b.build([b.call("index_put_add", x, values, ids, axes=(0,))])
    bad = np.array([1, 4, -1, 10**6, -5], np.int64)
    feeds = {"x": np.zeros((4, 3), np.float32), "values": np.ones((5, 3), np.float32), "ids": bad}
    (out,) = CBackend().compile(graph).run({}, feeds)
    np.testing.assert_array_equal(out.sum(axis=1), [0, 3, 0, 3])  # rows 1 and -1 only


# -- the exported ./train, built with sanitizers -------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The exported index_put model built with sanitizers, and its in-process losses of
    two steps on (IDS, POS)."""
    step, _ = _compile("index_put", "numpy")
    folder = step.export(tmp_path_factory.mktemp("indices") / "trainer", target="c")
    np.save(folder / "ids.npy", IDS)
    np.save(folder / "pos.npy", POS)
    make_trainer(folder, f"CFLAGS=-O0 -g {SANITIZE}", f"LDFLAGS={SANITIZE}")
    return folder, [step(*_batch()), step(*_batch())]


@needs_cc
def test_the_exported_trainer_takes_negative_indices_as_in_process(trainer: Any) -> None:
    folder, losses = trainer
    text = (folder / "README.md").read_text()
    assert "- `batch.0` (indexes): in [-7, 7)" in text
    assert "- `batch.1` (indexes): in [-5, 5)" in text
    run = _train(folder, "--steps", "2", "ids.npy", "pos.npy")
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize(
    ("ids", "pos", "bad", "message"),
    [
        ("bad.npy", "pos.npy", _with(IDS, 1, ROWS), "bad.npy: index 7 at flat position 1 is "
         "outside [-7, 7); 1 value(s) out of range in the file; nothing was trained"),
        ("bad.npy", "pos.npy", _with(IDS, 4, -ROWS - 1), "index -8 at flat position 4 is outside"),
        ("ids.npy", "bad.npy", np.stack([POS, _with(POS, 2, -(2**63))]),
         f"bad.npy: index {-(2**63)} at flat position 8 (index [1, 2]) is outside [-5, 5)"),
        ("ids.npy", "bad.npy", _with(POS, 0, 10**6), "index 1000000 at flat position 0"),
    ],
)  # fmt: skip
def test_the_exported_trainer_refuses_out_of_range_indices(
    trainer: Any, ids: str, pos: str, bad: Array, message: str
) -> None:
    folder, _ = trainer
    np.save(folder / "bad.npy", bad)
    shutil.copy(folder / "state.safetensors", folder / "prev.safetensors")
    before = _snapshot(folder)
    run = _train(folder, "--save", "prev.safetensors", ids, pos)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and run.stdout == "", run.stderr
    assert _snapshot(folder) == before


# -- the step artifact ----------------------------------------------------------------------


def _without_low(folder: Path) -> None:
    meta = json.loads((folder / "step.json").read_text())
    for bound in meta["index_bounds"]:
        del bound["low"]
    (folder / "step.json").write_text(json.dumps(meta))


def test_the_artifact_keeps_low_and_reads_older_ones_without_it(tmp_path: Path) -> None:
    step, _ = _compile("index_put", "numpy")
    loaded = load_step(step.save(tmp_path / "new"))
    assert loaded.facts.index_bounds == step.facts.index_bounds
    with pytest.raises(BatchError, match=r"index -8 at position 3 is outside \[-7, 7\)"):
        loaded(*_batch(_with(IDS, 3, -8)))
    # an artifact written before bounds had a low: gather and embedding bounds, all from 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
    cross_entropy: Callable[..., torch.Tensor] = nn.functional.cross_entropy
    ids, y = torch.ones(6, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    older = pe.compile(model, lambda m, i, t: cross_entropy(m(i), t), (ids, y))
    folder = older.save(tmp_path / "old")
    _without_low(folder)
    loaded = load_step(folder)
    assert loaded.facts.index_bounds == older.facts.index_bounds
    assert {b.low for b in loaded.facts.index_bounds} == {0}
    with pytest.raises(BatchError, match=r"token id -1 at position \(0, 0\) is outside \[0, 10\)"):
        loaded(-ids, y)
    assert loaded(ids, y) == pytest.approx(older(ids, y), rel=1e-6)
