"""Sparse backpropagation: schemes, pruned backward, partial channels, scheme files."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import schemes, zoo
from pockengine.ir import GRAD_PREFIX, Graph
from pockengine.passes import eliminate_dead_code
from pockengine.step.compiler import frozen_batchnorms, training_graph
from tests.torch_ref import torch_gradients


def _mbv2() -> zoo.Workload:
    return zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64))


def _backward_sources(graph: Graph) -> set[str]:
    return {n.source[len(GRAD_PREFIX) :] for n in graph.nodes if n.source.startswith(GRAD_PREFIX)}


def _check_subset(
    w: zoo.Workload, scheme: schemes.Scheme, rtol: float, atol: float
) -> pe.TrainStep:
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme)
    _, ref = torch_gradients(w, batch)
    got = step.gradients(*batch)
    assert set(got) == set(step.trained) and set(got) < set(ref)
    for name, g in got.items():
        want = ref[name][: g.shape[0]]
        np.testing.assert_allclose(g, want, rtol=rtol, atol=atol, err_msg=name)
    return step


@pytest.mark.parametrize(
    "scheme",
    [schemes.bias_only(), schemes.last_blocks(2), schemes.head(), schemes.sparse(blocks=2)],
    ids=["bias", "last2", "head", "sparse"],
)
def test_trained_gradients_equal_full_backprop_mbv2(scheme: schemes.Scheme) -> None:
    _check_subset(_mbv2(), scheme, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("scheme", [schemes.bias_only(), schemes.sparse(blocks=1)])
def test_trained_gradients_equal_full_backprop_transformers(scheme: schemes.Scheme) -> None:
    _check_subset(zoo.bert_classifier(), scheme, rtol=1e-4, atol=1e-5)
    _check_subset(zoo.llama_lm(), scheme, rtol=1e-4, atol=1e-5)


def test_last_blocks_stops_the_backward_at_the_first_trained_block() -> None:
    w = zoo.bert_classifier(layers=3)
    step = _check_subset(w, schemes.last_blocks(1), rtol=1e-4, atol=1e-5)
    sources = _backward_sources(step.graph)
    assert any(s.startswith("encoder.encoder.layer.2") for s in sources)
    assert not any(
        s.startswith(("encoder.encoder.layer.0", "encoder.encoder.layer.1")) for s in sources
    )
    assert not any(s.startswith("encoder.embeddings") for s in sources)


def test_head_only_backward_is_the_head() -> None:
    w = zoo.mlp()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.head())
    assert step.trained == ("4.weight", "4.bias")
    assert _backward_sources(step.graph) <= {"4", "<loss_fn>", "loss", "4.weight"}


def test_frozen_params_have_no_gradient_node() -> None:
    w = _mbv2()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.bias_only())
    assert not [n for n in step.graph.nodes if n.op == "conv2d_weight_grad"]
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.last_blocks(2))
    weight_grads = {n.source for n in step.graph.nodes if n.op == "conv2d_weight_grad"}
    assert weight_grads and all(
        s.startswith(("grad features.17", "grad features.18")) for s in weight_grads
    )


@pytest.mark.parametrize(
    "scheme",
    [schemes.full(), schemes.bias_only(), schemes.sparse(blocks=2, channels=0.5), schemes.head()],
)
def test_dead_code_elimination_finds_nothing_after_autodiff(scheme: schemes.Scheme) -> None:
    w = zoo.mobilenet_v2(width=0.35, batch=2, size=32)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme)
    forward = eliminate_dead_code(step.forward)  # the frontend may leave unread statistics
    graph, _, _ = training_graph(forward, step.optimizer, step.resolution.rows)
    assert eliminate_dead_code(graph) is graph


def test_partial_channels_give_the_slice_of_the_full_gradient() -> None:
    w = _mbv2()
    pattern = {
        "features.17.conv.*.weight": 0.25,
        "features.18.0.weight": 0.5,
        "classifier.1.weight": 0.5,
    }
    scheme = schemes.select(["features.17.*", "features.18.*", "classifier.*"], channels=pattern)
    step = _check_subset(w, scheme, rtol=1e-7, atol=1e-10)
    rows = step.resolution.rows
    assert rows["features.17.conv.1.0.weight"] is not None  # the depthwise conv
    for name, k in rows.items():
        if k is not None:
            assert step.gradients(*w.make_batch(0))[name].shape[0] == k
    # the weight-gradient convolutions run on the slice: no full-size one is left
    full_shapes = {p.shape for p in step.info.params if rows.get(p.name)}
    for node in step.graph.nodes:
        if node.op == "conv2d_weight_grad":
            assert node.attrs["w_shape"] not in full_shapes or node.attrs["w_shape"][0] == 1


def test_partial_channels_on_linear_layers_compute_the_slice_only() -> None:
    w = zoo.bert_classifier()
    scheme = schemes.sparse(blocks=1, channels=0.25)
    step = _check_subset(w, scheme, rtol=1e-4, atol=1e-5)
    q = "encoder.encoder.layer.1.attention.self.query.weight"
    assert step.resolution.rows[q] == 16
    producers = [n for n in step.graph.nodes if n.op == "matmul" and n.source == f"grad {q[:-7]}"]
    assert producers and all(64 * 64 not in {o.type.numel for o in n.outputs} for n in producers)


@pytest.mark.parametrize("backend", ["numpy", "torch", "c", "onnxruntime"])
@pytest.mark.parametrize("padding_idx", [None, 3, 60])
def test_a_tied_heads_leading_rows_never_make_the_whole_tables_gradient(
    backend: str, padding_idx: int | None
) -> None:
    """A causal LM whose head is its token embedding, trained on the first 16 of 64 rows:
    the lookup's gradient scatters only the ids below 16 into 16 rows (``sink_slices``),
    equal to torch.autograd's gradient of those rows, on every backend; no [64, dim]
    gradient is made. A padding row inside the trained rows keeps its padding rule (its
    lookups add nothing; the head's share still reaches it); one beyond them needs none."""
    w = zoo.llama_lm(layers=1, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64, seq=6,
                     batch=2, tied=True)  # fmt: skip
    if padding_idx is not None:
        w.model.model.embed_tokens.padding_idx = padding_idx
    batch = w.make_batch(0)
    batch = (torch.where(batch[0] % 5 == 0, padding_idx or 0, batch[0]), *batch[1:])
    emb = "model.embed_tokens.weight"
    scheme = schemes.select([emb], channels={emb: 0.25})
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme, backend=backend)
    grads = [n for n in step.graph.nodes if n.op == "embedding_grad"]
    assert grads and all(n.output.shape == (16, 16) for n in grads)
    assert all(n.attrs["padding_idx"] == (padding_idx if padding_idx == 3 else None)
               for n in grads)  # fmt: skip
    _, ref = torch_gradients(w, batch)
    got = step.gradients(*batch)[emb]
    np.testing.assert_allclose(got, ref[emb][:16], rtol=1e-4, atol=1e-5)


def test_partial_channel_training_leaves_frozen_rows_alone() -> None:
    w = zoo.mlp()
    model = copy.deepcopy(w.model)
    scheme = schemes.full(channels={"0.weight": 0.5})
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.SGD(lr=0.1), scheme)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        batch = w.make_batch(i)
        step(*batch)
        opt.zero_grad()
        w.loss_fn(model, *batch).backward()
        model[0].weight.grad[32:] = 0  # the torch equivalent: frozen rows get no update
        opt.step()
    ours = step.state_dict()
    np.testing.assert_array_equal(ours["0.weight"][32:], w.model[0].weight.detach().numpy()[32:])
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_frozen_batchnorm_can_use_running_statistics() -> None:
    w = _mbv2()
    scheme = schemes.last_blocks(1, frozen_bn="eval")
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme)
    # (a batch norm recomputed in the backward pass carries "grad " + the same source)
    bn_sources = {n.source.removeprefix("grad ") for n in step.graph.nodes if n.op == "batch_norm"}
    assert bn_sources and all(s.startswith("features.18") for s in bn_sources)
    assert w.model.training and all(m.training for m in w.model.modules())


def test_pattern_matching_nothing_lists_nearest_names() -> None:
    w = zoo.mlp()
    with pytest.raises(pe.SchemeError, match=r"'2\.wieght' matches no parameter.*2\.weight"):
        pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.select(["2.wieght"]))
    with pytest.raises(pe.SchemeError, match="no block container"):
        pe.compile(
            w.model, w.loss_fn, w.make_batch(0), scheme=schemes.last_blocks(1, container="x")
        )


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_scheme_files_round_trip(tmp_path: object, suffix: str) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / f"scheme{suffix}"
    for scheme in [
        schemes.sparse(blocks=3, channels=0.5, frozen_bn="eval"),
        schemes.select(["a.*"], ["a.b"], channels={"a.w": 0.25}),
        schemes.last_blocks(2, container="features"),
        schemes.bias_only(),
        schemes.running_statistics(schemes.bias_only()),
        schemes.running_statistics(schemes.lora(4)) | schemes.head(),
    ]:
        schemes.save(scheme, path)
        assert schemes.load(path) == scheme


def test_bad_scheme_file_is_a_clear_error(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "s.json"
    path.write_text('{"scheme": "nonsense"}')
    with pytest.raises(pe.SchemeError, match="unknown scheme 'nonsense'"):
        schemes.load(path)
    path.write_text("{not json")
    with pytest.raises(pe.SchemeError, match="does not parse"):
        schemes.load(path)


def test_frozen_batchnorms_fold_into_their_convs_and_gradients_match_torch() -> None:
    """Eval-mode BatchNorms of frozen layers fold into the conv before them (no per-channel
    multiply on the activations remains); loss and trained-param gradients equal
    torch.autograd on the model whose frozen BatchNorms are in eval mode."""
    w = _mbv2()
    batch = w.make_batch(0)
    scheme = schemes.last_blocks(1, frozen_bn="eval")
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme)
    unfused = step.forward_stages[0][1]
    convs = [n for n in unfused.nodes if n.op == "conv2d"]
    assert sum(n.op == "batch_norm" for n in step.forward.nodes) < len(convs)
    producers = step.forward.producers()
    for node in step.forward.nodes:  # no conv output is scaled per channel any more
        if node.op == "mul":
            assert all(
                producers.get(v.name) is None or producers[v.name].op != "conv2d"
                for v in node.inputs
            ), node
    model = copy.deepcopy(w.model)
    frozen = frozen_batchnorms(step.info, step.resolution)
    assert "features.18.1" not in frozen and "features.17.conv.1.1" in frozen
    for name, module in model.named_modules():
        if name in frozen:
            module.eval()
    trained = set(step.trained)
    loss = w.loss_fn(model, *batch)
    loss.backward()
    got = step.gradients(*batch)
    assert set(got) == trained
    for name, p in model.named_parameters():
        if name in trained:
            assert p.grad is not None
            np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-7, atol=1e-9,
                                       err_msg=name)  # fmt: skip
    assert step(*batch) == pytest.approx(float(loss), rel=1e-9)


def test_running_statistics_train_every_batchnorm_s_scale_on_its_running_statistics(
    tmp_path: object,
) -> None:
    """``batchnorm="running"``: every BatchNorm normalises by its running statistics,
    trained ones too; their scale and shift still train. The gradients are autograd's on
    the model with every BatchNorm in eval mode, the running statistics never move, and
    the mode survives a scheme file, a union and a saved step."""
    from pathlib import Path

    from pockengine.step.parts import batchnorm_modules, eval_batchnorms

    w = _mbv2()
    batch = w.make_batch(0)
    scheme = schemes.running_statistics(schemes.bias_only())
    assert scheme.to_dict() == {"scheme": "bias_only", "batchnorm": "running"}
    assert (schemes.head() | scheme).batchnorm == "running"
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme)
    assert step.resolution.running_bn
    assert eval_batchnorms(step.info, step.resolution) == batchnorm_modules(step.info)
    # a trained scale is not folded into its convolution (that would need the frozen
    # convolution's whole weight gradient): every convolution reads its weight as it is
    params = {v.name for v in step.forward.params}
    convs = [n for n in step.forward.nodes if n.op == "conv2d"]
    assert convs and all(n.inputs[1].name in params for n in convs)
    assert not any(n.op == "conv2d_weight_grad" for n in step.graph.nodes)
    model = copy.deepcopy(w.model)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()
    loss = w.loss_fn(model, *batch)
    loss.backward()
    got = step.gradients(*batch)
    trained = set(step.trained)
    assert "features.18.1.weight" in trained and set(got) == trained
    for name, p in model.named_parameters():
        if name in trained:
            np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=name)  # fmt: skip
    before = step.state_dict()
    step(*batch)
    after = step.state_dict()
    stats = [n for n in before if n.endswith(("running_mean", "running_var"))]
    assert stats and all(np.array_equal(before[n], after[n]) for n in stats)
    batch_mode = pe.compile(w.model, w.loss_fn, batch, scheme=schemes.bias_only())
    assert not batch_mode.resolution.running_bn
    assert not np.allclose(batch_mode.gradients(*batch)["features.18.1.weight"],
                           got["features.18.1.weight"])  # fmt: skip
    folder = Path(str(tmp_path)) / "step"
    step.save(folder)
    assert pe.load_step(folder).resolution.running_bn
    with pytest.raises(pe.SchemeError, match="batchnorm must be 'batch' or 'running'"):
        schemes.from_dict({"scheme": "bias_only", "batchnorm": "eval"})
