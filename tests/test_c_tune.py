"""``CBackend(tune=True)``: each conv node's kernel chosen by measurement, cached in a
table under the C cache dir. A tiny CNN (dense, depthwise and pointwise convolutions, each
with both gradients) trains as NumPy does whichever kernels the measurement picks; the
table is written and read back without measuring; a corrupt table is ignored with a
warning and written anew; the report names each tuned node's kernel."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend, layout_tune, tune
from pockengine.backends.c.conv_kernels import candidates, conv_geometry, rule_kernel
from pockengine.backends.c.driver import has_fast_gemm
from pockengine.backends.c.layout import nhwc_candidate

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kernel table in ``tmp_path`` (kernel objects stay in the shared cache); every
    convolution stays NCHW (the layout choice is tested in test_c_layout.py)."""
    monkeypatch.setattr(tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(layout_tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(
        layout_tune,
        "measure_layouts",
        lambda op, nchw, *a: {nchw: 1e-6, layout_tune.NHWC_KERNEL: 1.0},
    )
    return tmp_path / tune.CACHE_NAME


class Spy:
    """Stands for ``tune.measure``: counts the kernels timed; with ``favour``, that kernel
    takes 1 us and every other 2 us (so it wins wherever it is a candidate), else the real
    timing."""

    def __init__(self, favour: str | None = None) -> None:
        self.favour = favour
        self.calls = 0
        self.real = tune.measure

    def __call__(self, op: str, kernels: list[str], *args: Any) -> dict[str, float]:
        self.calls += len(kernels)
        if self.favour is None:
            return self.real(op, kernels, *args)
        return {k: 1e-6 if k == self.favour else 2e-6 for k in kernels}


def _compile(w: zoo.Workload, backend: Any) -> Any:
    opt = pe.optim.SGD(lr=0.05, momentum=0.9)
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt, backend=backend)


def _losses(step: Any, w: zoo.Workload) -> list[float]:
    return [step(*w.make_batch(i)) for i in range(5)]


def _tunable(step: Any) -> list[Any]:
    """The conv nodes of ``step`` with more than one valid kernel."""
    convs = [n for n in step._exec.graph.nodes if n.op.startswith("conv2d")]
    return [n for n in convs if len(candidates(n.op, conv_geometry(n))) > 1]


def _rule(step: Any, output: str) -> str:
    """The rule's kernel for this machine's native build (as ``CBackend()`` compiles)."""
    node = next(n for n in step._exec.graph.nodes if n.outputs and n.outputs[0].name == output)
    size, fast = node.outputs[0].dtype.itemsize, has_fast_gemm(None)
    return rule_kernel(node.op, conv_geometry(node), size, fast_gemm=fast)


@pytest.mark.parametrize("favour", [None, "direct", "im2col", "winograd", "winograd4"])
def test_tuned_steps_train_as_numpy_does(
    table: Path, monkeypatch: pytest.MonkeyPatch, favour: str | None
) -> None:
    """Measured choices, and every node pushed onto direct loops, the implicit GEMM,
    Winograd F(2x2, 3x3) or F(4x4, 3x3) (off the rule wherever they are valid): 5 SGD steps
    match NumPy's losses and weights; the report lists every tuned node with its kernel."""
    monkeypatch.setattr(tune, "measure", Spy(favour))
    w = zoo.small_cnn()
    want = _compile(w, "numpy")
    step = _compile(w, CBackend(tune=True))
    choices = step._exec.kernel_choices
    tunable = _tunable(step)
    assert tunable and [c.output for c in choices] == [n.outputs[0].name for n in tunable]
    if favour is not None:
        assert all(c.kernel == favour for c in choices if favour in c.seconds)
        assert any(c.kernel != _rule(step, c.output) for c in choices)
    np.testing.assert_allclose(_losses(step, w), _losses(want, w), rtol=1e-4, atol=1e-5)
    for name, value in want.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    text = str(step.report())
    assert "C kernels" in text
    for c in choices:
        assert any(c.output in line and c.kernel in line for line in text.splitlines())
    assert step.report().to_dict()["c_kernels"][0]["kernel"] == choices[0].kernel


def test_untuned_step_takes_the_rule_and_measures_nothing(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy()
    monkeypatch.setattr(tune, "measure", spy)
    step = _compile(zoo.small_cnn(), CBackend())
    assert spy.calls == 0 and not table.exists() and step._exec.kernel_choices == []
    assert "C kernels" not in str(step.report())
    for node in step._exec.graph.nodes:
        if node.op.startswith("conv2d"):
            kernel = _rule(step, node.outputs[0].name)
            assert f"pe_{node.op}_{kernel}_f32(" in step._exec.source


def test_the_table_is_written_and_a_second_compile_measures_nothing(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy("direct")
    monkeypatch.setattr(tune, "measure", spy)
    w = zoo.small_cnn()
    first = _compile(w, CBackend(tune=True))
    assert spy.calls > 0 and table.exists()
    data = json.loads(table.read_text())
    kernels = {c.kernel for c in first._exec.kernel_choices}
    assert {e["kernel"] for e in data["entries"].values()} == kernels
    assert not any(c.cached for c in first._exec.kernel_choices)
    spy.calls = 0
    second = _compile(w, CBackend(tune=True))
    assert spy.calls == 0
    assert all(c.cached for c in second._exec.kernel_choices)
    assert [c.kernel for c in second._exec.kernel_choices] == [
        c.kernel for c in first._exec.kernel_choices
    ]
    assert "(cached)" in str(second.report())
    # the exported trainer (maybe cross-compiled) takes the rule, not this machine's choices
    source = (second.export(table.parent / "trainer", target="c") / "step.c").read_text()
    rules = {(c.op, _rule(second, c.output)) for c in second._exec.kernel_choices}
    assert any(kernel != "direct" for _, kernel in rules)
    for op, kernel in rules:
        assert f"pe_{op}_{kernel}_f32(" in source
        assert f"pe_{op}_direct_f32(" in second._exec.source


@pytest.mark.parametrize(
    "corrupt",
    ["{not json", "[1, 2]", '{"format": "other", "version": 1, "entries": {}}', "\xff\xfe"],
    ids=["not-json", "a-list", "wrong-format", "bad-bytes"],
)
def test_a_corrupt_table_is_ignored_with_a_warning_and_rewritten(
    table: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, corrupt: str
) -> None:
    table.write_bytes(corrupt.encode("latin-1"))
    spy = Spy("direct")
    monkeypatch.setattr(tune, "measure", spy)
    with caplog.at_level(logging.WARNING, logger=tune.__name__):
        step = _compile(zoo.small_cnn(), CBackend(tune=True))
    assert any(str(table) in r.getMessage() for r in caplog.records)
    assert spy.calls > 0
    data = json.loads(table.read_text())
    assert data["format"] == "pockengine-conv-kernels"
    assert len(data["entries"]) == len({(n.op, conv_geometry(n)) for n in _tunable(step)})
    assert all(e["kernel"] == "direct" for e in data["entries"].values())


def test_malformed_or_impossible_entries_are_measured_again(
    table: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries are data: a wrong type, a negative or boolean time, an unknown kernel, or a
    kernel that cannot compute the node (pointwise for a 3x3 convolution) is not used."""
    monkeypatch.setattr(tune, "measure", Spy("direct"))
    w = zoo.small_cnn()
    _compile(w, CBackend(tune=True))
    data = json.loads(table.read_text())
    keys = sorted(data["entries"])
    bad = [
        {"kernel": "direct", "seconds": {"direct": -1.0}},
        {"kernel": "direct", "seconds": {"direct": True}},
        {"kernel": "fft", "seconds": {"fft": 1e-6}},
        {"kernel": "direct", "seconds": "1e9"},
        "direct",
    ]
    dense = next(k for k in keys if k.startswith("conv2d ") and "g=4,3," in k)
    for key, entry in zip([k for k in keys if k != dense], bad, strict=False):
        data["entries"][key] = entry
    data["entries"][dense] = {"kernel": "pointwise", "seconds": {"pointwise": 1e-9}}
    table.write_text(json.dumps(data))
    spy = Spy("direct")
    monkeypatch.setattr(tune, "measure", spy)
    with caplog.at_level(logging.WARNING, logger=tune.__name__):
        step = _compile(w, CBackend(tune=True))
    assert any("malformed" in r.getMessage() for r in caplog.records)
    fresh = {c.output for c in step._exec.kernel_choices if not c.cached}
    nodes = [n for n in _tunable(step) if n.outputs[0].name in fresh]
    assert len({(n.op, conv_geometry(n)) for n in nodes}) == len(bad) + 1  # those spoilt
    assert spy.calls > 0
    assert all(c.kernel == "direct" for c in step._exec.kernel_choices)
    entries = json.loads(table.read_text())["entries"]
    assert all(isinstance(e, dict) and e["kernel"] == "direct" for e in entries.values())


def test_a_node_s_candidates_are_timed_on_one_set_of_operands_with_an_early_stop() -> None:
    """``measure`` times a node's candidates in turn in one harness call: each a finite
    median when none is given up; with a give-up factor of 0 every candidate after the
    first is dropped on its warm-up run alone (inf)."""
    step = _compile(zoo.small_cnn(), CBackend())
    node = next(n for n in _tunable(step) if n.op == "conv2d")
    g, dtype = conv_geometry(node), node.outputs[0].dtype
    names = list(candidates(node.op, g))
    assert list(tune.measure(node.op, names, dtype, g, None, 1)) == names
    harness_times = tune.tune_harness.harness_times
    seconds = harness_times(node.op, names, dtype, g, 0.001, float("inf"), None, 1)
    assert len(seconds) == len(names) and all(0 < t < 1 for t in seconds)
    dropped = harness_times(node.op, names, dtype, g, 0.001, 0.0, None, 1)
    assert 0 < dropped[0] < 1 and all(t == float("inf") for t in dropped[1:])


def test_the_nhwc_candidate_is_timed_in_its_kernels_harness_call(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold tuned compile times each layout candidate node's variants (``nhwc``, and
    ``nchwc`` for depthwise ones) after its NCHW kernels, in one real harness call
    (``layout_tune.layout_beside``): the layout choice gets the chosen kernel's and the
    variants' times from it and times nothing itself; it keeps a layout exactly where those
    times say so; both tables are written, and a second compile measures nothing."""
    spy = Spy()
    monkeypatch.setattr(tune, "measure", spy)
    given: list[Any] = []

    def layouts(op: str, nchw: str, *a: Any) -> dict[str, float]:
        given.append(a[4])
        assert a[4] is not None and set(a[4]) == {nchw, *a[5]}, "not timed beside its kernels"
        return dict(a[4])

    monkeypatch.setattr(layout_tune, "measure_layouts", layouts)
    w = zoo.small_cnn()
    step = _compile(w, CBackend(tune=True))
    want = _compile(w, "numpy")
    np.testing.assert_allclose(_losses(step, w), _losses(want, w), rtol=1e-4, atol=1e-5)
    choices = {c.output: c for c in step._exec.kernel_choices}
    nodes = [n for n in _tunable(_compile(w, CBackend())) if nhwc_candidate(n)]
    assert nodes and len(given) == len({(n.op, conv_geometry(n)) for n in nodes})
    variants = layout_tune.LAYOUT_KERNELS
    for node in nodes:  # a variant's time is absent where its warm-up alone gave it up
        seconds = choices[node.outputs[0].name].seconds
        nchw = min((k for k in seconds if k not in variants), key=seconds.__getitem__)
        best = min(variants, key=lambda k: seconds.get(k, np.inf))
        wins = seconds.get(best, np.inf) < layout_tune.MARGIN * seconds[nchw]
        assert choices[node.outputs[0].name].kernel == (best if wins else nchw)
    layout_table = json.loads((table.parent / layout_tune.CACHE_NAME).read_text())["entries"]
    assert len(layout_table) == len(given)
    calls, given[:] = spy.calls, []
    again = _compile(w, CBackend(tune=True))
    assert spy.calls == calls and given == []
    assert all(c.cached for c in again._exec.kernel_choices)


def test_a_saved_step_reports_the_kernels_its_loading_backend_chose(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tuned step, saved and loaded again: loaded with ``CBackend(tune=True)`` its report
    lists the kernels that backend chose (from the table: nothing measured again); loaded
    with the rule's backend, none, since it runs the rule's."""
    spy = Spy("direct")
    monkeypatch.setattr(tune, "measure", spy)
    w = zoo.small_cnn()
    step = _compile(w, CBackend(tune=True))
    folder = step.save(table.parent / "step")
    spy.calls = 0
    tuned = pe.load_step(folder, backend=CBackend(tune=True))
    assert spy.calls == 0
    listed = tuned.report().to_dict()["c_kernels"]
    assert [(k["output"], k["kernel"]) for k in listed] == [
        (c.output, c.kernel) for c in step._exec.kernel_choices
    ]
    assert all(k["cached"] for k in listed) and "C kernels" in str(tuned.report())
    plain = pe.load_step(folder, backend=CBackend())
    assert "c_kernels" not in plain.report().to_dict() and "C kernels" not in str(plain.report())
    assert tuned(*w.make_batch(1)) == pytest.approx(plain(*w.make_batch(1)), rel=1e-4)
