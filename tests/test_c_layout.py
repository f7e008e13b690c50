"""The C backend's layout pass (``backends/c/layout.py``) and its measured choice
(``layout_tune.py``).

- On a small graph (two depthwise convolutions in a row with both gradients, and a
  pointwise one), ``apply_layouts`` converts each chosen node's activations once (the
  forward convolution and its weight gradient share one NHWC copy of x), cancels the
  NHWC -> NCHW -> NHWC pair between the two depthwise convolutions, keeps every original
  result's name and type, computes what the graph computed (NumPy), and the C memory plan
  places every converted buffer; ``cancel_inverse_conversions`` drops an explicit pair.
- The same chain in the channel-blocked NCHW{c}c (the depthwise nodes; the pointwise one
  NHWC): one blocked copy of x and of gy, the blocked pair between the two depthwise
  convolutions cancelled, the same values in NumPy and C.
- The heuristic puts depthwise convolutions on maps of at most 16 positions in NHWC where
  the rule's NCHW kernel is not the blocked one.
- Whole models train as NumPy does over 5 steps with every candidate forced onto NHWC, or
  the depthwise ones onto NCHW{c}c, with measured layouts, and with the heuristic's: the
  small CNN and MobileNetV2 (width 0.35); the report lists the candidates' times, a
  second compile measures nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend, layout, layout_tune, tune
from pockengine.backends.c.conv_kernels import rule_kernel
from pockengine.backends.c.layout import (
    HEURISTIC_MAX_MAP,
    NCHW,
    NHWC,
    apply_layouts,
    blocked_layout,
    cancel_inverse_conversions,
    heuristic_layout,
    heuristic_nhwc,
    layout_candidates,
    nhwc_candidate,
)
from pockengine.backends.c.plan_step import plan_step_memory
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.frontend.import_memo import reused_imports
from pockengine.ir import CompileError, DType, Graph, GraphBuilder, Role, TensorType, verify
from tests.trainer_losses import trainer_losses

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_GEOM = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1)}


def _chain() -> tuple[Graph, dict[str, Any]]:
    """x -> depthwise a -> depthwise b -> pointwise p, with the input and weight gradients
    of a and b for an incoming gy (no autodiff: the pass sees the nodes as written)."""
    b = GraphBuilder("chain")
    f32 = DType.F32
    x = b.input("x", TensorType((2, 8, 4, 4), f32), Role.INPUT)
    wa = b.input("wa", TensorType((8, 1, 3, 3), f32), Role.INPUT)
    wb = b.input("wb", TensorType((8, 1, 3, 3), f32), Role.INPUT)
    wp = b.input("wp", TensorType((6, 8, 1, 1), f32), Role.INPUT)
    gy = b.input("gy", TensorType((2, 8, 4, 4), f32), Role.INPUT)
    a = b.call("conv2d", x, wa, groups=8, **_GEOM)
    y = b.call("conv2d", a, wb, groups=8, **_GEOM)
    p = b.call("conv2d", y, wp, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)
    ga = b.call("conv2d_input_grad", gy, wb, x_shape=a.shape, groups=8, **_GEOM)
    gwb = b.call("conv2d_weight_grad", a, gy, w_shape=(8, 1, 3, 3), groups=8, **_GEOM)
    gwa = b.call("conv2d_weight_grad", x, ga, w_shape=(8, 1, 3, 3), groups=8, **_GEOM)
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in b.build([p]).inputs}
    return b.build([p, ga, gwb, gwa]), feeds


def _ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_the_pass_converts_once_cancels_pairs_and_keeps_the_values() -> None:
    graph, feeds = _chain()
    convs = [n.outputs[0].name for n in graph.nodes if n.op.startswith("conv2d")]
    assert all(nhwc_candidate(n) is not None for n in graph.nodes)
    after = verify(apply_layouts(graph, convs))
    assert "conv2d" not in " ".join(_ops(after)).replace("conv2d_nhwc", "")
    converts = [n for n in after.nodes if n.op == "layout_convert"]
    into = sorted(n.inputs[0].name for n in converts if n.attrs["dst"] == NHWC)
    # one NHWC copy of x (read by a and by gwa), one of gy (ga and gwb); a's NHWC result
    # feeds b and gwb directly: its NCHW copy is read by nothing and went
    assert into == ["gy", "x"]
    a_name = graph.nodes[0].outputs[0].name
    assert all(v.name != a_name for n in after.nodes for v in n.outputs)
    # every returned value keeps its name and type
    assert [(v.name, v.type) for v in after.outputs] == [(v.name, v.type) for v in graph.outputs]
    want = NumpyBackend().compile(graph).run(dict(feeds))
    got = NumpyBackend().compile(after).run(dict(feeds))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    ran = CBackend().compile(after).run({}, dict(feeds))
    for g, w in zip(ran, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # the memory plan places every converted buffer
    plan = plan_step_memory(after)
    made = [v.name for n in after.nodes for v in n.outputs if v.name.endswith(".nhwc")]
    assert made and all(name in plan.offsets for name in made)


def test_the_pass_lays_depthwise_convolutions_out_in_channel_blocks() -> None:
    graph, feeds = _chain()
    blocked = blocked_layout(DType.F32)
    assert blocked == "NCHW16c"
    chosen = {n.outputs[0].name: layout_candidates(n)[-1] for n in graph.nodes}
    depthwise = {n.outputs[0].name for n in graph.nodes if n.attrs["groups"] == 8}
    assert {k for k, v in chosen.items() if v == blocked} == depthwise  # pointwise: NHWC only
    after = verify(apply_layouts(graph, chosen))
    ops = _ops(after)
    assert ops.count("conv2d_nchwc") == 2 and ops.count("conv2d_nchwc_weight_grad") == 2
    assert ops.count("conv2d_nchwc_input_grad") == 1 and ops.count("conv2d_nhwc") == 1
    converts = [n for n in after.nodes if n.op == "layout_convert"]
    into = sorted(n.inputs[0].name for n in converts if n.attrs["dst"] == blocked)
    assert into == ["gy", "x"]  # a's blocked result feeds b and gwb directly
    assert [(v.name, v.type) for v in after.outputs] == [(v.name, v.type) for v in graph.outputs]
    want = NumpyBackend().compile(graph).run(dict(feeds))
    got = NumpyBackend().compile(after).run(dict(feeds))
    ran = CBackend().compile(after).run({}, dict(feeds))
    for g, r, w in zip(got, ran, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r, w, rtol=1e-4, atol=1e-4)
    plan = plan_step_memory(after)
    made = [v.name for n in after.nodes for v in n.outputs if v.name.endswith(".nchw16c")]
    assert made and all(name in plan.offsets for name in made)
    with pytest.raises(CompileError, match="NCHW16c"):  # the pointwise node has no blocked kernel
        apply_layouts(graph, dict.fromkeys(chosen, blocked))


def test_an_explicit_inverse_pair_cancels() -> None:
    b = GraphBuilder("pair")
    x = b.input("x", TensorType((1, 3, 2, 2), DType.F32), Role.INPUT)
    t = b.call("layout_convert", x, src="NCHW", dst="NCHW8c", channels=3)
    u = b.call("layout_convert", t, src="NCHW8c", dst="NCHW", channels=3)
    r = b.call("relu", u)
    after = cancel_inverse_conversions(b.build([r]))
    assert _ops(after) == ["relu"] and after.nodes[0].inputs[0].name == "x"


def test_a_convolution_without_an_nhwc_kernel_is_refused() -> None:
    b = GraphBuilder("dense")
    x = b.input("x", TensorType((1, 4, 5, 5), DType.F32), Role.INPUT)
    w = b.input("w", TensorType((6, 4, 3, 3), DType.F32), Role.INPUT)
    y = b.call("conv2d", x, w, groups=1, **_GEOM)
    with pytest.raises(CompileError, match=y.name):
        apply_layouts(b.build([y]), [y.name])


def test_the_heuristic_takes_nhwc_for_depthwise_convolutions_on_small_maps() -> None:
    """Where the rule's NCHW kernel is not ``blocked`` (which folds the conversion in):
    the chain's 4x4 maps run the blocked kernels in NCHW; a 9x9 filter (more taps than
    the blocked kernels gather) on the same map takes NHWC."""
    graph, _ = _chain()
    assert heuristic_nhwc(graph) == set()
    for node in graph.nodes:
        g = nhwc_candidate(node)
        assert g is not None
        small = g.depthwise and g.oh * g.ow <= HEURISTIC_MAX_MAP
        for fast in (False, True):  # both builds' rules agree on these small maps
            assert (rule_kernel(node.op, g, 4, fast_gemm=fast) == "blocked") == small
        assert heuristic_layout(node.op, g) == NCHW
    b = GraphBuilder("wide")
    x = b.input("x", TensorType((2, 8, 4, 4), DType.F32), Role.INPUT)
    w = b.input("w", TensorType((8, 1, 9, 9), DType.F32), Role.INPUT)
    y = b.call("conv2d", x, w, stride=(1, 1), padding=(4, 4), dilation=(1, 1), groups=8)
    wide = b.build([y])
    assert heuristic_nhwc(wide) == {y.name}


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(layout_tune, "cache_dir", lambda: tmp_path)
    return tmp_path


def _train(w: zoo.Workload, backend: Any, scheme: Any = None, opt: Any = None) -> Any:
    opt = opt or pe.optim.SGD(lr=0.05, momentum=0.9)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt, backend=backend,
                      scheme=scheme)  # fmt: skip
    return [step(*w.make_batch(i)) for i in range(5)], step


def _favour_nhwc(op: str, nchw: str, *args: Any) -> dict[str, float]:
    return {nchw: 2e-6, layout_tune.NHWC_KERNEL: 1e-6}


def _favour_nchw(op: str, nchw: str, *args: Any) -> dict[str, float]:
    return {nchw: 1e-6, layout_tune.NHWC_KERNEL: 2e-6}


def _favour_blocked(op: str, nchw: str, *args: Any) -> dict[str, float]:
    return {nchw: 3e-6, layout_tune.NHWC_KERNEL: 2e-6, layout_tune.BLOCKED_KERNEL: 1e-6}


@pytest.mark.parametrize("how", ["forced", "blocked", "measured", "heuristic"])
def test_the_small_cnn_trains_as_numpy_in_every_layout(
    how: str, tables: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how in ("forced", "blocked"):
        favour = _favour_nhwc if how == "forced" else _favour_blocked
        monkeypatch.setattr(layout_tune, "measure_layouts", favour)
    if how == "heuristic":  # the depthwise layer's map is 16x16
        monkeypatch.setattr(layout, "HEURISTIC_MAX_MAP", 256)
    want, _ = _train(zoo.small_cnn(), "numpy")
    got, step = _train(zoo.small_cnn(), CBackend(tune=how != "heuristic"))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    nodes = step._exec.graph.nodes
    nhwc = [n for n in nodes if n.op.startswith("conv2d_nhwc")]
    blocked = [n for n in nodes if n.op.startswith("conv2d_nchwc")]
    if how == "forced":  # the depthwise and pointwise layers, forward and both gradients
        assert len(nhwc) == 6 and any(n.op == "layout_convert" for n in nodes)
    if how == "blocked":  # the depthwise layer blocked, the pointwise one NHWC
        assert len(blocked) == 3 and len(nhwc) == 3
        assert {n.attrs["block"] for n in blocked} == {16}
    if how == "heuristic":  # the depthwise layer, forward and both gradients
        assert len(nhwc) == 3
    if how != "heuristic":
        report = step.report()
        assert all(layout_tune.NHWC_KERNEL in c.seconds for c in report.kernels if
                   c.output in {n.outputs[0].name for n in nhwc})  # fmt: skip
        assert layout_tune.NHWC_KERNEL in str(report) or how == "measured"
        if how == "blocked":
            assert layout_tune.BLOCKED_KERNEL in str(report)
        again = pe.compile(zoo.small_cnn().model, zoo.small_cnn().loss_fn,
                           zoo.small_cnn().make_batch(0), backend=CBackend(tune=True))  # fmt: skip
        assert all(c.cached for c in again._exec.kernel_choices)


@pytest.mark.parametrize("scheme_name", ["sparse", pytest.param("full", marks=pytest.mark.slow)])
def test_mobilenet_trains_as_numpy_with_every_candidate_in_nhwc(
    scheme_name: str, tables: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MobileNetV2 (width 0.35, 32 px; float64 and AdamW at 1e-4, as test_c_backend's,
    since float32 gradients of this random network are ill-conditioned): every depthwise
    and pointwise layer NHWC gives the NCHW C step's losses (to 1e-9), and NumPy's
    (sparse, to 1e-5; full training of this batch of 2 is ill-conditioned enough that the
    NCHW C step itself is 3e-3 from NumPy by step 4); so does every depthwise layer in
    NCHW8c (the pointwise ones NHWC)."""
    monkeypatch.setattr(tune, "measure", lambda op, kernels, *a: {k: 1e-6 for k in kernels})
    scheme = pe.schemes.sparse(blocks=4) if scheme_name == "sparse" else None

    w = zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=2, size=32))

    def run(backend: Any) -> Any:
        return _train(w, backend, scheme, pe.optim.AdamW(lr=1e-4))

    with reused_imports():  # one torch.export of the model for its compiles
        monkeypatch.setattr(layout_tune, "measure_layouts", _favour_nchw)
        nchw, _ = run(CBackend(tune=True))
        monkeypatch.setattr(layout_tune, "measure_layouts", _favour_nhwc)
        monkeypatch.setattr(layout_tune, "cache_dir", lambda: tables / "nhwc")
        (tables / "nhwc").mkdir()
        got, step = run(CBackend(tune=True))
        np.testing.assert_allclose(got, nchw, rtol=1e-9)
        if scheme_name == "sparse":
            want, _ = run("numpy")
            np.testing.assert_allclose(got, want, rtol=1e-5)
        monkeypatch.setattr(layout_tune, "measure_layouts", _favour_blocked)
        monkeypatch.setattr(layout_tune, "cache_dir", lambda: tables / "blocked")
        (tables / "blocked").mkdir()
        in_blocks, blocked_step = run(CBackend(tune=True))
        np.testing.assert_allclose(in_blocks, nchw, rtol=1e-9)
    ops = _ops(step._exec.graph)
    assert ops.count("conv2d_nhwc") > 10 and "conv2d_nhwc_weight_grad" in ops
    blocked = [n for n in blocked_step._exec.graph.nodes if n.op.startswith("conv2d_nchwc")]
    assert len(blocked) > 10 and {n.attrs["block"] for n in blocked} == {8}
    assert "conv2d_nchwc_weight_grad" in _ops(blocked_step._exec.graph)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_an_exported_trainer_runs_the_heuristic_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small CNN with the heuristic's limit raised to its depthwise layer's 16x16 map:
    the step and the exported trainer both run that layer in NHWC, and ./train's losses
    are the step's."""

    monkeypatch.setattr(layout, "HEURISTIC_MAX_MAP", 256)
    w = zoo.small_cnn()
    opt = pe.optim.SGD(lr=0.05, momentum=0.9)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt, backend="c")
    assert any(n.op == "conv2d_nhwc" for n in step._exec.graph.nodes)
    folder = step.export(tmp_path / "trainer", target="c")
    assert "pe_conv2d_nhwc_depthwise_f32(" in (folder / "step.c").read_text()
    batches = [w.make_batch(i) for i in range(3)]
    losses = [step(*b) for b in batches]
    np.testing.assert_allclose(trainer_losses(folder, batches), losses, rtol=1e-4)
