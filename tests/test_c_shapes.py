"""``CBackend(tune=True)``: each GEMM node's micro-kernel shape chosen by measurement
(``shape_tune.py``). The build lists three shapes per dtype; a node whose measured shape is
not the default has ``pe_gemm_shape`` set around its statement; every shape trains the
same bits as the default; the table is written and read back without measuring; a
corrupt table is ignored with a warning; the report shows each node's shape and times."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine.backends.c import CBackend, backend, layout_tune, shape_tune, tune, tune_harness
from pockengine.backends.c.driver import has_fast_gemm
from pockengine.ir import DType

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shape table in ``tmp_path`` (kernel objects stay in the shared cache)."""
    for module in (tune, layout_tune, shape_tune):
        monkeypatch.setattr(module, "cache_dir", lambda: tmp_path)
    return tmp_path / shape_tune.CACHE_NAME


class Spy:
    """Stands for the harness's timings of shapes: counts the runs timed; shape ``favour``
    takes 1 us and every other 2 us, or with ``favour`` None the real timing."""

    def __init__(self, favour: int | None) -> None:
        self.favour = favour
        self.calls = 0
        self.real_products = tune_harness.gemm_times
        self.real_convs = tune_harness.harness_times

    def _fake(self, shapes: tuple[int, ...]) -> list[float]:
        self.calls += len(shapes)
        return [1e-6 if s == self.favour else 2e-6 for s in shapes]

    def products(self, dtype: DType, product: Any, shapes: tuple[int, ...], *args: Any) -> Any:
        if self.favour is None:
            self.calls += len(shapes)
            return self.real_products(dtype, product, shapes, *args)
        return self._fake(shapes)

    def convs(self, *args: Any, shapes: tuple[int, ...] | None = None, **kw: Any) -> Any:
        if shapes is None:  # a conv kernel's timing (tune.py), not a shape's
            return self.real_convs(*args, **kw)
        if self.favour is None:
            self.calls += len(shapes)
            return self.real_convs(*args, shapes=shapes, **kw)
        return self._fake(shapes)


def _spy(monkeypatch: pytest.MonkeyPatch, favour: int | None) -> Spy:
    """The shapes' timings faked (or counted), and every convolution on a GEMM kernel."""
    spy = Spy(favour)
    monkeypatch.setattr(tune, "measure", lambda op, kernels, *a, **k: {
        name: 1e-6 if name in shape_tune.GEMM_CONV_KERNELS else 2e-6 for name in kernels
    })  # fmt: skip
    monkeypatch.setattr(tune_harness, "gemm_times", spy.products)
    monkeypatch.setattr(tune_harness, "harness_times", spy.convs)
    return spy


class Mixer(nn.Module):
    """Products big enough to be timed: linear layers, a batched matmul with a transposed
    operand, and a pointwise and a dense convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)
        self.point = nn.Conv2d(32, 48, 1)
        self.up = nn.Linear(48, 96)
        self.down = nn.Linear(96, 384)  # 4 x 384 x 96: past the least timed work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.point(torch.relu(self.conv(x))))  # [n, 48, 12, 12]
        t = y.flatten(2).transpose(1, 2)  # [n, 144, 48]
        t = torch.relu(self.up(t))  # [n, 144, 96]
        scores = t @ t.transpose(1, 2) / 96  # [n, 144, 144]
        t = torch.softmax(scores, -1) @ t
        return self.down(t.mean(1))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)


def _compile(backend: Any) -> Any:
    torch.manual_seed(0)
    model = Mixer()
    opt = pe.optim.SGD(lr=0.05, momentum=0.9)
    return pe.compile(model, _loss, _batch(0), optimizer=opt, backend=backend)


def _losses(step: Any) -> list[float]:
    return [step(*_batch(i)) for i in range(5)]


def test_the_build_lists_three_shapes_per_dtype() -> None:
    f32 = tune_harness.gemm_shapes(DType.F32, None)
    f64 = tune_harness.gemm_shapes(DType.F64, None)
    portable = tune_harness.gemm_shapes(DType.F32, True)
    assert len(f32) == len(f64) == len(portable) == 3
    assert portable == f64 == ("4x8", "8x4", "2x16")
    assert len(set(f32)) == 3 and all(m * n >= 32 for m, n in (map(int, s.split("x")) for s in f32))
    if has_fast_gemm(None):
        assert f32[0] in ("12x32", "6x16")


@pytest.mark.parametrize("favour", [1, 2])
def test_every_shape_trains_the_default_shapes_bits(
    table: Path, monkeypatch: pytest.MonkeyPatch, favour: int
) -> None:
    """Every GEMM node pushed onto shape 1 or 2: the source sets it around each of them,
    and 5 SGD steps give the default shape's losses and weights bit for bit (each element
    sums its products in k order whatever the shape), close to NumPy's."""
    want = _compile("numpy")
    spy = _spy(monkeypatch, favour)
    with monkeypatch.context() as m:
        m.setattr(backend, "choose_shapes", lambda *a, **k: [])
        default = _compile(CBackend(tune=True))
    step = _compile(CBackend(tune=True))
    assert spy.calls > 0
    shaped = step._exec._gemm_shapes
    ops = {n.outputs[0].name: n.op for n in step._exec.graph.nodes if n.outputs}
    assert {ops[k] for k in shaped} >= {"linear", "matmul", "conv2d", "conv2d_weight_grad"}
    assert set(shaped.values()) == {favour}
    source = step._exec.source
    assert source.count(f"pe_gemm_shape = {favour};") == len(shaped)
    assert "pe_gemm_shape = " not in default._exec.source
    losses = _losses(step)
    assert losses == _losses(default)
    for name, value in default.state_dict().items():
        np.testing.assert_array_equal(step.state_dict()[name], value)
    np.testing.assert_allclose(losses, _losses(want), rtol=1e-4, atol=1e-5)


def test_measured_shapes_are_cached_and_reported(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real timings: every timed node has a finite time for each shape and keeps one; the
    table holds them, a second compile measures nothing and reads the same choices; the
    report lists each node's shape and the other shapes' times."""
    spy = _spy(monkeypatch, None)
    first = _compile(CBackend(tune=True))
    assert spy.calls > 0 and table.exists()
    labels = tune_harness.gemm_shapes(DType.F32, None)
    choices = [c for c in first._exec.kernel_choices if c.shape]
    assert choices and all(c.shape in labels for c in choices)
    for c in choices:
        assert set(c.shape_seconds) == set(labels)
        assert all(math.isfinite(t) and t > 0 for t in c.shape_seconds.values())
        assert c.time == c.shape_seconds[c.shape]
        best = min(c.shape_seconds.values())
        assert c.shape == labels[0] or c.time == best
    data = json.loads(table.read_text())
    assert data["format"] == "pockengine-conv-kernels" and data["entries"]
    assert {e["kernel"] for e in data["entries"].values()} <= set(labels)
    spy.calls = 0
    second = _compile(CBackend(tune=True))
    assert spy.calls == 0
    again = [c for c in second._exec.kernel_choices if c.shape]
    assert [(c.output, c.shape) for c in again] == [(c.output, c.shape) for c in choices]
    assert all(c.cached for c in again)
    text = str(second.report())
    for c in again:
        line = next(x for x in text.splitlines() if f" {c.output} " in x)
        assert c.shape in line and "others:" in line
    kernels = second.report().to_dict()["c_kernels"]
    assert {k["shape"] for k in kernels if k["shape"]} <= set(labels)


@pytest.mark.parametrize(
    "corrupt",
    ["{not json", '{"format": "other", "version": 1, "entries": {}}', "\xff\xfe"],
    ids=["not-json", "wrong-format", "bad-bytes"],
)
def test_a_corrupt_table_is_ignored_with_a_warning(
    table: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, corrupt: str
) -> None:
    table.write_bytes(corrupt.encode("latin-1"))
    spy = _spy(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger=tune.__name__):
        step = _compile(CBackend(tune=True))
    assert any(str(table) in r.getMessage() for r in caplog.records)
    assert spy.calls > 0 and set(step._exec._gemm_shapes.values()) == {2}
    data = json.loads(table.read_text())
    assert data["entries"] and all(e["kernel"] == data["entries"][k]["kernel"]
                                   for k, e in data["entries"].items())  # fmt: skip


def test_a_malformed_entry_is_measured_again(
    table: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries are data: a shape the build does not have, a negative time or a wrong type
    is not used; the node is timed again."""
    _spy(monkeypatch, 1)
    _compile(CBackend(tune=True))
    data = json.loads(table.read_text())
    keys = sorted(data["entries"])
    bad = [
        {"kernel": "99x99", "seconds": {"99x99": 1e-9}},
        {"kernel": "4x8", "seconds": {"4x8": -1.0}},
        {"kernel": 3, "seconds": {}},
    ]
    for key, entry in zip(keys, bad, strict=False):
        data["entries"][key] = entry
    table.write_text(json.dumps(data))
    spy = _spy(monkeypatch, 1)
    with caplog.at_level(logging.WARNING, logger=tune.__name__):
        step = _compile(CBackend(tune=True))
    assert spy.calls >= min(len(keys), len(bad))
    assert set(step._exec._gemm_shapes.values()) == {1}


def test_a_shape_is_kept_only_past_the_margin() -> None:
    labels = ("12x32", "24x16", "6x64")
    near = shape_tune._entry(labels, [1.0, 0.99, 1.2])
    assert near["kernel"] == "12x32"
    far = shape_tune._entry(labels, [1.0, 0.9, 0.95])
    assert far["kernel"] == "24x16" and far["seconds"] == {"12x32": 1.0, "24x16": 0.9,
                                                           "6x64": 0.95}  # fmt: skip
    untimed = shape_tune._entry(labels, [math.inf, 0.5, 0.6])
    assert untimed == {"kernel": "12x32", "seconds": {"12x32": 0.0}}


def test_untuned_and_exported_steps_run_the_default_shape(
    table: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No measurement without ``tune``; the exported trainer (maybe cross-compiled) runs
    the shape its own table names (``./train --tune``; the default without one), never
    a shape this machine measured."""
    spy = _spy(monkeypatch, 2)
    plain = _compile(CBackend())
    assert spy.calls == 0 and not table.exists()
    assert "pe_gemm_shape" not in plain._exec.source
    tuned = _compile(CBackend(tune=True))
    assert "pe_gemm_shape = 2;" in tuned._exec.source
    source = (tuned.export(tmp_path / "trainer", target="c") / "step.c").read_text()
    assert "pe_gemm_shape = 2;" not in source and "pe_gemm_shape = pe_gemm_choice[0];" in source


def test_the_harness_times_every_shape_of_a_product() -> None:
    seconds = tune_harness.gemm_times(DType.F32, (70, 50, 40, 1, 0), (0, 1, 2), 0.001,
                                      float("inf"), None, 1)  # fmt: skip
    assert len(seconds) == 3 and all(math.isfinite(t) and t > 0 for t in seconds)
    f64 = tune_harness.gemm_times(DType.F64, (33, 65, 17, 0, 1), (2, 0), 0.001,
                                  float("inf"), True, 1)  # fmt: skip
    assert len(f64) == 2 and all(math.isfinite(t) and t > 0 for t in f64)


def test_a_shape_is_kept_only_where_the_node_runs_what_was_timed() -> None:
    """After the layout pass and a memory budget: a convolution whose kernel is no longer
    the one its shapes were timed with, or a node whose op changed, runs the default."""
    step = _compile(CBackend())
    graph = step._exec.graph
    conv = next(n for n in graph.nodes if n.op == "conv2d" and n.inputs[1].shape[-1] == 1)
    name = conv.outputs[0].name
    timed = {"a": 1.0, "b": 0.5}
    shape = shape_tune.GemmShape("conv2d", name, 2, "b", timed, "im2col", False, "a")
    assert backend._kept_shapes(graph, {name: "im2col"}, [shape], False) == {name: 2}
    assert backend._kept_shapes(graph, {name: "pointwise"}, [shape], False) == {}
    moved = shape_tune.GemmShape("matmul", name, 2, "b", timed, "", False, "a")
    assert backend._kept_shapes(graph, {}, [moved], False) == {}
    gone = shape_tune.GemmShape("matmul", "no-such-node", 1, "b", timed, "", False, "a")
    assert backend._kept_shapes(graph, {}, [gone], False) == {}
