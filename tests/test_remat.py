"""Rematerialisation (``passes.remat``): cheap activations recomputed in the backward pass.

- MobileNetV2: every ReLU6 output the backward reads is recomputed (batch norm repeated
  and clamped) just before its first backward reader; the forward ReLU6 outputs are no
  longer read by the backward; the saved bytes and the planned arena fall by a third or
  more on full and bias-only training;
- the same losses, params and momenta, bit for bit, with and without the pass, on the
  NumPy and torch backends;
- a convolution's input and weight gradients stay one paired ATen call on the torch
  backend (the recomputed input is made before the input gradient);
- LLaMA's gated MLP: sigmoid(gate) and silu(gate) recomputed from gate, sigmoid(gate)
  once, and not saved;
- nothing to do on a graph without a backward pass, or one whose saved values are not
  cheap to recompute.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.ir import Graph, Phase, verify
from pockengine.passes import DEFAULT_PIPELINE, remat, rematerialize, run_pipeline
from pockengine.passes.remat import MAX_DEPTH, _cheap, recompute
from pockengine.plan import plan_memory
from pockengine.plan.report import analyze

WITHOUT = tuple(p for p in DEFAULT_PIPELINE if p is not rematerialize)


def _backward(node: Any) -> bool:
    return node.phase is Phase.BACKWARD


_SCHEMES = {
    "full": pe.schemes.full(),
    "bias": pe.schemes.bias_only(),
    "bias-running": pe.schemes.running_statistics(pe.schemes.bias_only()),
}


@functools.cache
def _mbv2(scheme: str, batch: int = 2, size: int = 32) -> Graph:
    """MobileNetV2's training graph as autodiff and the optimizer leave it (before passes)."""
    work = zoo.mobilenet_v2(width=0.35, batch=batch, size=size)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0),
                      pe.optim.SGD(lr=0.05, momentum=0.9), _SCHEMES[scheme])  # fmt: skip
    return step.stages[0][1]


@pytest.mark.parametrize("scheme", ["full", "bias"])
def test_relu6_outputs_are_recomputed(scheme: str) -> None:
    before = run_pipeline(_mbv2(scheme), WITHOUT).graph
    after = run_pipeline(_mbv2(scheme), check=True).graph
    producers = after.producers()
    grads = [n for n in after.nodes if n.op == "hardtanh_grad"]
    assert grads
    for n in grads:  # the backward reads a recomputed output, made by a backward node
        made = producers[n.inputs[1].name]
        assert made.op == "hardtanh" and _backward(made)
        assert _backward(producers[made.inputs[0].name])  # batch norm, repeated
    for n in after.nodes:  # and no forward relu6 output is read by the backward
        if n.op == "hardtanh" and not _backward(n):
            readers = after.users().get(n.outputs[0].name, [])
            assert not any(_backward(r) for r in readers), n
    saved0, saved1 = analyze(before).saved_activation_bytes, analyze(after).saved_activation_bytes
    arena0, arena1 = plan_memory(before).arena_bytes, plan_memory(after).arena_bytes
    assert saved1 < 0.6 * saved0 and arena1 < 0.8 * arena0, (saved0, saved1, arena0, arena1)


def _train(
    backend: str, passes: Any = None, scheme: str = "bias"
) -> tuple[list[float], dict[str, Any], pe.TrainStep]:
    work = zoo.mobilenet_v2(width=0.35, batch=2, size=32)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0),
                      pe.optim.SGD(lr=0.05, momentum=0.9), _SCHEMES[scheme],
                      backend=backend, passes=passes)  # fmt: skip
    losses = [step(*work.make_batch(k)) for k in range(3)]
    return losses, step.flat_state_dict(), step


@pytest.mark.parametrize(
    ("backend", "scheme"), [("numpy", "bias"), ("torch", "bias"), ("numpy", "bias-running")]
)
def test_same_training_bit_for_bit(backend: str, scheme: str) -> None:
    loss1, state1, step1 = _train(backend, scheme=scheme)
    loss0, state0, step0 = _train(backend, WITHOUT, scheme)  # compile(passes=...) honoured
    assert [name for name, _ in step0.stages][1:] == [p.__name__ for p in WITHOUT]
    assert len(step1.graph.nodes) > len(step0.graph.nodes)  # the pass did recompute
    assert loss1 == loss0
    assert state1.keys() == state0.keys()
    for name, value in state0.items():
        np.testing.assert_array_equal(state1[name], value, err_msg=name)


def test_running_statistics_save_what_batch_statistics_save() -> None:
    """A BatchNorm on its running statistics whose shift trains is ``conv * s + h``, with
    ``s`` and ``h`` per-channel values made from its params: kept alive (a few bytes),
    the ReLU6 output is recomputed from the conv output, as with batch statistics (where
    the activation is at least ``KEEP_RATIO`` times larger than ``s``: 4 x 64 px)."""
    batch = run_pipeline(_mbv2("bias", 4, 64), check=True).graph
    running = run_pipeline(_mbv2("bias-running", 4, 64), check=True).graph
    without = run_pipeline(_mbv2("bias-running", 4, 64), WITHOUT).graph
    saved = {
        k: analyze(g).saved_activation_bytes
        for k, g in (("batch", batch), ("running", running), ("without", without))
    }
    assert saved["running"] <= 1.02 * saved["batch"], saved
    assert saved["running"] < 0.6 * saved["without"], saved
    recomputed = [n for n in running.nodes if _backward(n) and n.op == "hardtanh"]
    assert len(recomputed) == sum(n.op == "hardtanh_grad" for n in running.nodes) > 10


def test_conv_gradients_stay_paired_on_torch() -> None:
    from pockengine.backends.torch.backend import TorchBackend

    sources = []
    for passes in (WITHOUT, DEFAULT_PIPELINE):
        graph = run_pipeline(_mbv2("full"), passes).graph
        sources.append(TorchBackend().compile(graph).source)
    both = "(True, True, False)"  # convolution_backward computing input and weight grads
    assert sources[0].count(both) > 10
    assert sources[1].count(both) == sources[0].count(both)


def test_gated_mlp_recomputes_sigmoid_and_silu() -> None:
    work = zoo.llama_lm(layers=1, hidden=32, heads=2, ffn=48, vocab=64, seq=8, batch=1)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW())
    graph = verify(step.graph)
    recomputed = [n for n in graph.nodes if _backward(n) and ".mlp." in n.source
                  and n.op in ("sigmoid", "mul") and not n.op.endswith("_grad")]  # fmt: skip
    ops = sorted(n.op for n in recomputed if n.outputs[0].name.endswith(("_re0", "_re1")))
    assert ops == ["mul", "sigmoid"], ops
    # sigmoid(gate) is made once again in the backward, inside silu's chain (for the
    # up-projection's gradient), and that copy serves silu's own gradient: the forward's
    # sigmoid(gate) is not saved (it was, and made twice, until session 19)
    forward = [n for n in graph.nodes if n.op == "sigmoid" and not _backward(n)]
    read_back = {v.name for n in graph.nodes if _backward(n) for v in n.inputs}
    assert len(forward) == 1 and forward[0].outputs[0].name not in read_back
    assert sum(n.op == "sigmoid" and _backward(n) for n in graph.nodes) == 1


def test_grouped_query_keys_and_values_are_saved_narrow() -> None:
    """Grouped-query attention: the keys and values expanded to every query head are not
    saved; the narrow ones are kept and expanded again at the attention's backward (a
    chain may keep a forward value at most half the size of what it recomputes), for
    fewer saved bytes and the same training, bit for bit."""
    work = zoo.llama_lm(layers=2, hidden=32, heads=4, kv_heads=1, ffn=48, vocab=64, seq=8,
                        batch=2)  # fmt: skip

    def trained(passes: Any) -> tuple[pe.TrainStep, list[float]]:
        step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(),
                          passes=passes)  # fmt: skip
        return step, [step(*work.make_batch(k)) for k in range(3)]

    def wide(g: Graph) -> Graph:  # rematerialize as before: no narrow value kept
        return recompute(g, _cheap, MAX_DEPTH, prefer=_cheap)

    with pytest.MonkeyPatch.context() as patch:  # this model's tensors are a few KiB
        patch.setattr(remat, "NARROW_MIN_SAVING", 0)
        step, losses = trained(None)
        widened = tuple(wide if p is rematerialize else p for p in DEFAULT_PIPELINE)
        saved = [analyze(g).saved_activation_bytes for g in (
            step.graph,
            *(run_pipeline(step.stages[0][1], passes).graph for passes in (widened, WITHOUT)),
        )]  # fmt: skip
    graph = verify(step.graph)
    producers = graph.producers()
    grads = [n for n in graph.nodes if n.op == "attention_grad"]
    assert len(grads) == 2
    for n in grads:  # k and v: expanded to 4 heads by backward nodes, from 1-head values
        for kv in n.inputs[2:4]:
            made = producers[kv.name]
            assert _backward(made) and kv.shape[1] == 4, (made.op, kv.shape)
    assert saved[0] < saved[1] < saved[2], saved
    _, plain_losses = trained(WITHOUT)
    assert losses == plain_losses


def test_only_cheap_ops_are_recomputed() -> None:
    forward_only = _mbv2("bias").replace(nodes=tuple(
        n for n in _mbv2("bias").nodes if not _backward(n) and not n.source.startswith("optim")
    ))  # fmt: skip
    assert rematerialize(forward_only) is forward_only  # no backward: nothing saved
    mlp = zoo.mlp()
    step = pe.compile(mlp.model, mlp.loss_fn, mlp.make_batch(0), pe.optim.SGD(lr=0.1))
    graph = step.stages[0][1]
    after = rematerialize(graph)
    made = {v.name for n in graph.nodes for v in n.outputs}
    new = [n for n in after.nodes if n.outputs and n.outputs[0].name not in made]
    # the gelu output (for the next layer's weight gradient) from the saved gelu input, and
    # transposed views of the weights; never a matmul
    assert sorted(n.op for n in new) == ["gelu", "transpose", "transpose"]
    assert all(_backward(n) for n in new)
