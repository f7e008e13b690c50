"""The fused large-vocabulary loss: ``passes.fuse_loss`` rewrites the frontends'
``gather(log_softmax(x @ w (+ b)), target)`` into ``linear_log_softmax_gather`` (and, on
the training graph, merges it with its backward kernel where the loss's gradient is
known before the loss is: ``fuse_loss_backward``), and the result equals the unfused
graph and torch.autograd (loss and every gradient), on the torch frontend (a classifier
head with ignored targets, a LLaMA causal LM with tied and untied embeddings, a causal
shift by slicing the logits) and the ONNX frontend's ``causal_lm`` loss; the ``[tokens,
vocab]`` logits exist nowhere in the training graph. The op's kernels are checked on its
samples by the op table, torch, ONNX and C tests; the C kernels also over several row
chunks and vocabulary tiles, both weight layouts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import pockengine as pe
import pockengine.step.parts
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.c.backend import CBackend
from pockengine.backends.numpy.backend import evaluate
from pockengine.frontend.import_memo import reused_imports
from pockengine.ir import DType, Graph, GraphBuilder, Role, TensorType, Value, verify
from pockengine.passes import (
    FORWARD_PIPELINE,
    forward_passes,
    fuse_linear_cross_entropy,
    fuse_loss_backward,
)
from pockengine.passes.fuse_loss import FUSED_LOSS_OPS, MIN_VOCAB
from pockengine.plan.report import analyze
from pockengine.step.compiler import gradients_graph

Array = np.ndarray[Any, Any]
VOCAB = MIN_VOCAB  # the smallest vocabulary the default pipeline fuses
FUSED = "linear_log_softmax_gather"
WITH_GRAD = f"{FUSED}_with_grad"


class _Head(nn.Module):
    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))  # type: ignore[no-any-return]


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _head_batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, vocab, (6,), generator=g)
    y[2] = -100  # an ignored target
    return torch.randn(6, 8, generator=g), y


class _ShiftedLM(nn.Module):
    """A causal LM whose loss slices the logits (older transformers) instead of padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))  # type: ignore[no-any-return]


def _shifted_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _llama(tied: bool) -> zoo.Workload:
    return zoo.llama_lm(layers=1, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=VOCAB, seq=6,
                        batch=2, tied=tied)  # fmt: skip


@pytest.fixture
def unfused(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., pe.TrainStep]]:
    """``compile`` with the forward pipeline minus the fused loss."""

    def compile_unfused(*args: Any, **kwargs: Any) -> pe.TrainStep:
        with monkeypatch.context() as m:
            passes = tuple(p for p in FORWARD_PIPELINE if p is not fuse_linear_cross_entropy)
            m.setattr(pockengine.step.parts, "forward_passes", lambda supported: passes)
            return pe.compile(*args, **kwargs)

    yield compile_unfused


def _ops(graph: Graph) -> set[str]:
    return {n.op for n in graph.nodes}


def _vocab_sized(graph: Graph, tokens: int) -> list[str]:
    """Values shaped like the logits (``tokens`` rows of ``vocab``) anywhere in ``graph``."""
    return [
        v.name
        for n in graph.nodes
        for v in n.outputs
        if VOCAB in v.shape and v.type.numel == tokens * VOCAB
    ]


def _autograd(model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              batch: tuple[torch.Tensor, ...]) -> tuple[float, dict[str, Array]]:  # fmt: skip
    model = copy.deepcopy(model)
    loss = loss_fn(model, *batch)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _assert_grads(got: dict[str, Array], want: dict[str, Array], rtol: float = 1e-4) -> None:
    assert set(got) == set(want)
    for name, g in got.items():
        scale = float(np.max(np.abs(want[name]))) or 1.0
        np.testing.assert_allclose(g, want[name], rtol=rtol, atol=rtol * scale, err_msg=name)


def test_classifier_head_is_fused_and_matches_autograd() -> None:
    model, batch = _Head(), _head_batch()
    step = pe.compile(model, _classify, batch)
    assert FUSED in _ops(step.forward) and "log_softmax" not in _ops(step.forward)
    # the mean's gradient is known before the loss: the op and its backward are one node
    assert WITH_GRAD in _ops(step.graph) and not {FUSED, f"{FUSED}_grad"} & _ops(step.graph)
    assert _vocab_sized(step.graph, tokens=6) == []
    want_loss, want = _autograd(model, _classify, batch)
    _assert_grads(step.gradients(*batch), want)
    assert step(*batch) == pytest.approx(want_loss, rel=1e-6)


def test_a_loss_whose_gradient_reads_it_keeps_the_backward_kernel() -> None:
    """A squared per-token loss: its cotangent needs the picked log-probabilities, so the
    forward op and its backward stay two nodes (the backward after the loss)."""

    def squared(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y, reduction="none").square().mean()

    model, batch = _Head(), _head_batch()
    batch[1][batch[1] < 0] = 0  # no ignored rows: their zero loss is fine squared too
    step = pe.compile(model, squared, batch)
    assert {FUSED, f"{FUSED}_grad"} <= _ops(step.graph) and WITH_GRAD not in _ops(step.graph)
    want_loss, want = _autograd(model, squared, batch)
    _assert_grads(step.gradients(*batch), want)
    assert step(*batch) == pytest.approx(want_loss, rel=1e-6)


def test_merging_the_backward_keeps_the_numbers_and_saves_a_matmul() -> None:
    """fuse_loss_backward on the shifted head's gradients graph: the same loss and
    gradients as the two nodes, one [tokens, k] x [k, vocab] product fewer, and neither
    the rows nor the log-sum-exp saved for a backward kernel."""
    fused = verify(fuse_linear_cross_entropy(_shifted_head_graph(), chunk_elements=4 * VOCAB))
    pair, _ = gradients_graph(fused)
    pair = verify(pair)
    merged = verify(fuse_loss_backward(pair))
    assert WITH_GRAD in _ops(merged) and not {FUSED, f"{FUSED}_grad"} & _ops(merged)
    (node,) = [n for n in merged.nodes if n.op == WITH_GRAD]
    assert node.attrs["chunk"] == 4 and len(node.inputs) == 6  # gp, scale, x, w, y, b
    rng = np.random.default_rng(1)
    y = rng.integers(0, VOCAB, 10)
    y[7] = -100
    feeds = {"x": rng.standard_normal((12, 8)), "w": rng.standard_normal((8, VOCAB)),
             "b": rng.standard_normal(VOCAB), "y": y}  # fmt: skip
    for a, b in zip(evaluate(merged, feeds), evaluate(pair, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    before, after = analyze(pair), analyze(merged)
    total = [f.forward_flops + f.backward_flops for f in (before, after)]
    assert total[0] - total[1] >= 2 * 10 * 8 * VOCAB  # one matmul of 10 rows fewer
    assert after.saved_activation_bytes < before.saved_activation_bytes
    assert fuse_loss_backward(merged) is merged


def test_small_vocabulary_or_logits_read_twice_stay_unfused() -> None:
    model, batch = _Head(vocab=10), _head_batch(vocab=10)
    assert FUSED not in _ops(pe.compile(model, _classify, batch).forward)

    def also_logits(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(x)
        return F.cross_entropy(logits, y) + 1e-3 * logits.square().mean()

    big, batch = _Head(), _head_batch()
    step = pe.compile(big, also_logits, batch)
    assert FUSED not in _ops(step.forward)
    _assert_grads(step.gradients(*batch), _autograd(big, also_logits, batch)[1])


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_llama_equals_unfused_and_autograd(
    tied: bool, unfused: Callable[..., pe.TrainStep]
) -> None:
    work = _llama(tied)
    batch = work.make_batch(0)
    fused = pe.compile(work.model, work.loss_fn, batch)
    plain = unfused(work.model, work.loss_fn, batch)
    assert FUSED in _ops(fused.forward) and FUSED not in _ops(plain.forward)
    got, base = fused.gradients(*batch), plain.gradients(*batch)
    _assert_grads(got, base, rtol=1e-5)
    want_loss, want = _autograd(work.model, work.loss_fn, batch)
    _assert_grads(got, want)
    assert fused(*batch) == pytest.approx(want_loss, rel=1e-6)
    assert plain(*batch) == pytest.approx(want_loss, rel=1e-6)
    assert fused(*batch) == pytest.approx(plain(*batch), rel=1e-5)  # after one update each
    tokens = 2 * 6
    assert _vocab_sized(fused.graph, tokens) == [] and _vocab_sized(plain.graph, tokens) != []
    figures = [analyze(s.graph) for s in (fused, plain)]
    logits = tokens * VOCAB * 4
    assert figures[1].planned_peak_bytes - figures[0].planned_peak_bytes > 0.25 * logits
    if not tied:  # no saved log-probabilities; a tied head's gradient, made by the merged
        # op at the forward's end, is held until the embedding's backward in both graphs
        saved = [f.saved_activation_bytes for f in figures]
        assert saved[1] - saved[0] > 0.9 * logits


def test_causal_shift_by_slicing_the_logits_is_fused() -> None:
    model = _ShiftedLM()
    ids = (torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2)),)
    step = pe.compile(model, _shifted_loss, ids)
    assert FUSED in _ops(step.forward) and "log_softmax" not in _ops(step.forward)
    want_loss, want = _autograd(model, _shifted_loss, ids)
    _assert_grads(step.gradients(*ids), want)
    assert step(*ids) == pytest.approx(want_loss, rel=1e-6)


def _onnx_lm(rng: np.random.Generator, width: int = 8) -> tuple[onnx.ModelProto, dict[str, Array]]:
    """ids -> Gather(embed) -> Tanh -> MatMul(w) -> Add(b): logits [2, 5, VOCAB]."""
    weights = {
        "embed": rng.standard_normal((VOCAB, width)).astype(np.float32),
        "w": (0.3 * rng.standard_normal((width, VOCAB))).astype(np.float32),
        "b": (0.1 * rng.standard_normal(VOCAB)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"]),
        helper.make_node("Tanh", ["e"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["z"]),
        helper.make_node("Add", ["z", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5, VOCAB])],
        [numpy_helper.from_array(a, k) for k, a in weights.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), weights


def test_onnx_causal_lm_is_fused_and_matches_autograd(tmp_path: Path) -> None:
    model, weights = _onnx_lm(np.random.default_rng(0))
    path = tmp_path / "lm.onnx"
    onnx.save(model, str(path))
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 5))
    step = pe.compile(str(path), loss="causal_lm", example_batch=(ids,))
    assert FUSED in _ops(step.forward) and "log_softmax" not in _ops(step.forward)
    params = {k: torch.tensor(a, requires_grad=True) for k, a in weights.items()}
    logits = torch.tanh(params["embed"][torch.tensor(ids)]) @ params["w"] + params["b"]
    t = torch.tensor(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), t[:, 1:].reshape(-1))
    loss.backward()
    want = {k: p.grad.numpy() for k, p in params.items() if p.grad is not None}
    _assert_grads(step.gradients(ids), want)
    assert step(ids) == pytest.approx(float(loss.detach()), rel=1e-6)


def _shifted_head_graph() -> Graph:
    """x [12, 8] -> add(matmul(x, w), b) -> [2, 6, V] -> slice(axis 1, 0:5) -> [10, V] ->
    log_softmax -> gather at where(y != -100, y, 0) -> mean of the negated picks."""
    b = GraphBuilder("forward")
    x = b.input("x", TensorType((12, 8), DType.F64))
    w = b.input("w", TensorType((8, VOCAB), DType.F64), Role.PARAM, trainable=True)
    bias = b.input("b", TensorType((VOCAB,), DType.F64), Role.PARAM, trainable=True)
    y = b.input("y", TensorType((10,), DType.I64))
    z = b.call("reshape", b.call("add", b.call("matmul", x, w), bias), shape=(2, 6, VOCAB))
    z = b.call("slice", z, axis=1, start=0, stop=5, step=1)
    logp = b.call("log_softmax", b.call("reshape", z, shape=(10, VOCAB)), axis=1)
    keep = b.call("ne", y, b.scalar(-100, DType.I64))
    safe = b.call("where", keep, y, b.scalar(0, DType.I64))
    picked = b.call("gather", logp, b.call("reshape", safe, shape=(10, 1)), axis=1)
    loss = b.call("neg", b.call("mean", picked, axes=None, keepdims=False))
    return b.build([loss])


def test_chunks_are_balanced_over_the_rows() -> None:
    """As few chunks as the element limit allows, of equal size: 10 tokens at up to 6 rows
    a chunk are two chunks of 5, not 6 and 4; at up to 4 rows, 4, 4 and 2; at up to 10
    or more, one chunk."""
    for most, chunk in ((6, 5), (4, 4), (3, 3), (10, 10), (64, 10), (1, 1)):
        fused = fuse_linear_cross_entropy(_shifted_head_graph(), chunk_elements=most * VOCAB)
        (node,) = [n for n in fused.nodes if n.op == FUSED]
        assert node.attrs["chunk"] == chunk, most


def test_the_pass_chunks_rows_and_keeps_the_numbers() -> None:
    """Chunks of 4 rows over 10 tokens (the last one short) give the unfused loss and
    gradients, through a bias and a sliced causal shift of the logits."""
    plain = _shifted_head_graph()
    fused = verify(fuse_linear_cross_entropy(plain, chunk_elements=4 * VOCAB))
    (node,) = [n for n in fused.nodes if n.op == FUSED]
    assert node.attrs["chunk"] == 4 and len(node.inputs) == 4  # x, w, target, bias
    assert "log_softmax" not in _ops(fused)
    rng = np.random.default_rng(0)
    y = rng.integers(0, VOCAB, 10)
    y[3] = -100
    feeds = {"x": rng.standard_normal((12, 8)), "w": rng.standard_normal((8, VOCAB)),
             "b": rng.standard_normal(VOCAB), "y": y}  # fmt: skip
    got, want = _loss_and_grads(fused, feeds), _loss_and_grads(plain, feeds)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert fuse_linear_cross_entropy(plain, min_vocab=VOCAB + 1) is plain


def _loss_and_grads(forward: Graph, feeds: dict[str, Array]) -> list[Array]:
    graph, _ = gradients_graph(forward)
    return list(evaluate(graph, feeds))


def test_backends_match_numpy() -> None:
    model, batch = _Head(), _head_batch()
    with reused_imports():  # one torch.export for the four backends
        reference = pe.compile(model, _classify, batch)
        want, want_loss = reference.gradients(*batch), reference(*batch)
        for backend in ("torch", "onnxruntime", "c"):
            step = pe.compile(model, _classify, batch, backend=backend)
            assert WITH_GRAD in _ops(step.graph), backend
            _assert_grads(step.gradients(*batch), want, rtol=1e-5)
            assert step(*batch) == pytest.approx(want_loss, rel=1e-6)


def test_out_of_range_targets_are_batch_errors() -> None:
    model, (x, y) = _Head(), _head_batch()
    step = pe.compile(model, _classify, (x, y))
    assert FUSED in _ops(step.forward)
    bad = y.clone()
    bad[4] = VOCAB
    with pytest.raises(pe.BatchError, match=rf"class target {VOCAB} at position 4"):
        step(x, bad)
    bad[4] = -1
    with pytest.raises(pe.BatchError, match="class target -1 at position 4"):
        step(x, bad)
    step(x, y)  # -100 is the ignore_index


def test_backends_without_the_kernels_keep_the_unfused_loss() -> None:
    lacking = CBackend().supported_ops() - FUSED_LOSS_OPS
    assert fuse_linear_cross_entropy not in forward_passes(lacking)
    for backend in ("torch", "c"):
        assert forward_passes(get_backend(backend).supported_ops()) == FORWARD_PIPELINE


_C_ROWS, _C_VOCAB = 300, 2500  # three row chunks of 128 (the last short), 20 vocab tiles


def _head_inputs(
    b: GraphBuilder, k: int, dtype: DType, major: bool, bias: bool, index_dtype: DType
) -> list[Value]:
    """gp, scale, x, w, index and (with ``bias``) b of a loss head of ``_C_ROWS`` rows,
    ``k`` features and ``_C_VOCAB`` classes, as graph inputs."""
    rows, vocab = _C_ROWS, _C_VOCAB
    gp, scale = (b.input(n, TensorType((rows,), dtype)) for n in ("gp", "scale"))
    x = b.input("x", TensorType((rows, k), dtype))
    w = b.input("w", TensorType((vocab, k) if major else (k, vocab), dtype))
    index = b.input("index", TensorType((rows,), index_dtype))
    extra = [b.input("b", TensorType((vocab,), dtype))] if bias else []
    return [gp, scale, x, w, index, *extra]


def _head_feeds(
    rng: np.random.Generator, graph: Graph, x_scale: float, w_scale: float
) -> dict[str, Array]:
    """Random values of ``_head_inputs``' inputs of ``graph``, in their dtypes; the targets
    include the last class and a tile's first one."""
    types = {v.name: v.type for v in graph.inputs}
    draws = {"x": rng.standard_normal(types["x"].shape) * x_scale,
             "w": rng.standard_normal(types["w"].shape) * w_scale,
             "index": rng.integers(0, _C_VOCAB, _C_ROWS), "gp": rng.standard_normal(_C_ROWS),
             "scale": rng.standard_normal(_C_ROWS), "b": rng.standard_normal(_C_VOCAB)}  # fmt: skip
    feeds = {n: a.astype(types[n].dtype.to_numpy()) for n, a in draws.items() if n in types}
    feeds["index"][[0, -1]] = [_C_VOCAB - 1, 1280]
    return feeds


@pytest.mark.parametrize(("dtype", "major", "bias"), [
    (DType.F32, True, False), (DType.F32, False, True), (DType.F64, True, True),
])  # fmt: skip
def test_c_kernels_over_chunks_and_tiles_match_numpy(dtype: DType, major: bool, bias: bool) -> None:
    """300 rows (three chunks of 128, the last short) over 2500 classes (20 tiles of
    128, the last short): the forward and every gradient equal the NumPy reference."""
    b = GraphBuilder("loss")
    gp, scale, x, w, index, *extra = _head_inputs(b, 24, dtype, major, bias,
                                                  DType.I32 if bias else DType.I64)  # fmt: skip
    attrs = {"chunk": 16, "vocab_major": major}
    picked, lse = b.call_multi(FUSED, x, w, index, *extra, **attrs)
    grads = b.call_multi(f"{FUSED}_grad", gp, scale, x, w, index, lse, *extra, **attrs,
                         x_grad=True, w_grad=True, b_grad=bias)  # fmt: skip
    graph = b.build([picked, lse, *grads])
    feeds = _head_feeds(np.random.default_rng(3), graph, x_scale=1, w_scale=1 / 4)
    got = CBackend().compile(graph).run(dict(feeds), {})
    want = evaluate(graph, dict(feeds))
    tol = 2e-4 if dtype is DType.F32 else 1e-10
    for name, g, ref in zip(("picked", "lse", "gx", "gw", "gb"), got, want, strict=False):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize(("dtype", "major", "bias", "grads", "k"), [
    (DType.F32, True, False, ("x",), 24), (DType.F32, False, True, ("x", "w", "b"), 24),
    (DType.F64, True, True, ("w",), 24), (DType.F64, False, False, ("x", "w"), 24),
    (DType.F32, True, False, ("x", "w"), 300), (DType.F32, False, False, ("x", "w"), 300),
])  # fmt: skip
def test_c_merged_kernel_over_chunks_and_tiles_matches_numpy(
    dtype: DType, major: bool, bias: bool, grads: tuple[str, ...], k: int
) -> None:
    """The merged op's one C kernel (the input gradient accumulated as the tiles go, the
    running max rescaling it) over 300 rows and 2500 classes, with any set of gradients:
    the forward and every gradient equal the NumPy reference, masked rows (scale and gp
    0) included. At 300 features each tile's products are large enough for the GEMM's
    packed path (``linalg.c``: PE_PACK_MIN), with A and B transposed or not."""
    b = GraphBuilder("loss")
    ins = _head_inputs(b, k, dtype, major, bias, DType.I64 if major else DType.I32)
    outs = b.call_multi(WITH_GRAD, *ins, chunk=16, vocab_major=major, x_grad="x" in grads,
                        w_grad="w" in grads, b_grad="b" in grads)  # fmt: skip
    graph = b.build(list(outs))
    feeds = _head_feeds(np.random.default_rng(4), graph, x_scale=2, w_scale=1 / 2)
    feeds["gp"][5] = feeds["scale"][5] = 0  # a masked row
    executable = CBackend().compile(graph)
    source = executable.source
    assert source.count("pe_linear_log_softmax_gather_with_grad_") == 1  # one kernel call
    assert "pe_linear_log_softmax_gather_f" not in source  # not the forward, then the grad
    got = executable.run(dict(feeds), {})
    want = evaluate(graph, dict(feeds))
    assert len(got) == len(want) == 2 + len(grads)
    tol = (2e-4 if k < 100 else 1e-3) if dtype is DType.F32 else 1e-10
    for name, g, ref in zip(("picked", "lse", *grads), got, want, strict=True):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, rtol=tol, atol=tol, err_msg=name)


def test_c_llama_trains_fused_as_numpy() -> None:
    """A tied-embedding LLaMA on the C backend: the loss is fused (no [tokens, vocab]
    value in the arena) and three steps equal the NumPy backend's."""
    work = _llama(tied=True)
    batches = [work.make_batch(i) for i in range(3)]
    opt = pe.optim.SGD(lr=0.1, momentum=0.9)  # AdamW would scale float32 noise up
    c_step = pe.compile(work.model, work.loss_fn, batches[0], opt, backend="c")
    reference = pe.compile(work.model, work.loss_fn, batches[0], opt, backend="numpy")
    assert WITH_GRAD in _ops(c_step.graph) and _vocab_sized(c_step.graph, 2 * 6) == []
    for batch in batches:
        assert c_step(*batch) == pytest.approx(reference(*batch), rel=1e-5)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(c_step.state_dict()[name], value, rtol=1e-4, atol=1e-5)
