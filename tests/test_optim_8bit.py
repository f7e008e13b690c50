"""AdamW with 8-bit block-wise moments (``adamw8bit_update``, ``AdamW(state_dtype="int8")``).

- the dynamic codes and block-wise round-to-nearest against a float64 brute force;
- one update against a float64 reference of the same dequantize / AdamW / quantize math;
- the torch kernel's float32 fast path (bins) equals ``searchsorted`` on awkward values;
- a whole model: the torch backend against the NumPy backend, the state's bytes, the loss
  against float32 AdamW's, and a checkpoint/resume round trip with int8 state;
- the options: ``state_dtype`` checks, ``--optimizer-state`` and its config checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch.kernels_optim import _code
from pockengine.finetune.cli import add_arguments, config_from_args
from pockengine.finetune.run_folder import checkpoint as ckpt_io
from pockengine.ir import CompileError, get_op
from pockengine.ops.update_8bit import (
    SIGNED_CODE,
    UNSIGNED_CODE,
    ZERO_BYTE,
    code_midpoints,
    dequantize_blockwise,
    quantize_blockwise,
)
from pockengine.optim import MIN_8BIT_SIZE, AdamW
from pockengine.scheme_choice.estimate import optimizer_of
from pockengine.tasks.config import FinetuneConfig, FinetuneError

Array = np.ndarray[Any, Any]
HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
CODES = {"signed": SIGNED_CODE, "unsigned": UNSIGNED_CODE}


def _nearest64(x: Array, code: Array, block: int) -> tuple[Array, Array]:
    """Block-wise round-to-nearest by brute force in float64: argmin |code - x / absmax|."""
    flat = x.astype(np.float64).reshape(-1)
    pad = np.concatenate([flat, np.zeros(-flat.size % block)]).reshape(-1, block)
    absmax = np.abs(pad).max(axis=1)
    normed = pad / np.where(absmax > 0, absmax, 1.0)[:, None]
    dist = np.abs(normed[..., None] - code.astype(np.float64))
    return dist.argmin(axis=-1).reshape(-1)[: flat.size].reshape(x.shape), absmax


def test_codes_are_sorted_dynamic_codes_with_an_exact_zero() -> None:
    for kind, code in CODES.items():
        assert code.shape == (256,) and code.dtype == np.float32
        assert np.all(np.diff(code) > 0), kind
        assert code[ZERO_BYTE[kind]] == 0 and code.max() == 1
        positive = code[code > 0]
        # a decimal exponent per group: values from about 1e-7 up to 1
        assert positive.min() < 1e-6 and positive.min() > 1e-8
    assert SIGNED_CODE.min() < -0.99 and UNSIGNED_CODE.min() == 0


@pytest.mark.parametrize("kind", ["signed", "unsigned"])
def test_blockwise_quantization_rounds_to_the_nearest_code(kind: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 50)) * np.logspace(-6, 0, 50)  # several magnitudes a block
    x = x if kind == "signed" else np.abs(x)
    x[0, :64] = 0.0  # a zero block
    code = CODES[kind]
    codes, absmax = quantize_blockwise(x, code, 64)
    want_codes, want_absmax = _nearest64(x, code, 64)
    np.testing.assert_array_equal(absmax, want_absmax)
    # ties aside (none in random data), the byte is the nearest code's
    np.testing.assert_array_equal(codes, want_codes)
    back = dequantize_blockwise(codes, absmax, code, 64)
    assert back.shape == x.shape and np.all(back[0, :64] == 0)


def _reference_update(
    w: Array, g: Array, state: tuple[Array, ...], t: float, lr: float, block: int
) -> tuple[Array, ...]:
    """The update in float64: dequantize m and sqrt(v), AdamW, quantize m and sqrt(v)
    by brute force."""
    mq, ma, vq, va = state
    m = dequantize_blockwise(mq, ma.astype(np.float64), SIGNED_CODE, block)
    root = dequantize_blockwise(vq, va.astype(np.float64), UNSIGNED_CODE, block)
    b1, b2, eps, wd = HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"]
    w = w.astype(np.float64) * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * root**2 + (1 - b2) * g * g
    w = w - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
    return (w, *_nearest64(m, SIGNED_CODE, block), *_nearest64(np.sqrt(v), UNSIGNED_CODE, block))


def test_update_matches_a_float64_reference_of_the_same_math() -> None:
    rng = np.random.default_rng(1)
    shape, block = (24, 40), 64
    w = rng.standard_normal(shape).astype(np.float32)
    m0 = (0.01 * rng.standard_normal(shape)).astype(np.float32)
    v0 = (1e-4 * rng.random(shape) * np.logspace(-4, 0, 40)).astype(np.float32)
    state = (*quantize_blockwise(m0, SIGNED_CODE, block),
             *quantize_blockwise(np.sqrt(v0), UNSIGNED_CODE, block))  # fmt: skip
    g = (0.01 * rng.standard_normal(shape)).astype(np.float32)
    t, lr = np.asarray(5.0, np.float32), np.asarray(1e-3, np.float32)
    got = get_op("adamw8bit_update").kernel(w, g, *state, t, lr, block=block, **HYPER)
    want = _reference_update(w, g.astype(np.float64), state, float(t), float(lr), block)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    for k in (2, 4):  # absmax
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
    for k in (1, 3):  # bytes: float32 rounding may move a value across a midpoint, by one
        diff = np.abs(got[k].astype(int) - want[k].astype(int))
        assert diff.max() <= 1 and np.mean(diff) < 0.01, (k, diff.max(), diff.mean())
    assert not np.array_equal(got[0], w)  # it did update


def test_float32_bins_equal_searchsorted() -> None:
    """The torch kernel's float32 rounding (bins of the float's bits) against NumPy's
    ``searchsorted`` on the midpoints themselves, their neighbours, zeros and signs."""
    rng = np.random.default_rng(2)
    for kind, code in CODES.items():
        mids = code_midpoints(code)
        near = np.concatenate([np.nextafter(mids, -np.inf), mids, np.nextafter(mids, np.inf)])
        edge = np.array([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, 0.5], np.float32)
        x = np.concatenate([near, edge, rng.uniform(-1, 1, 10_000).astype(np.float32),
                            (rng.standard_normal(10_000) * 1e-5).astype(np.float32)])  # fmt: skip
        x = x.astype(np.float32) if kind == "signed" else np.abs(x).astype(np.float32)
        want = np.searchsorted(mids, x, side="left")
        tx = torch.from_numpy(x)
        got = _code(kind == "signed", tx).nearest(tx).numpy()
        np.testing.assert_array_equal(got, want, err_msg=kind)


def _compile(optimizer: AdamW, backend: str = "torch", llama: bool = False) -> tuple[Any, Any]:
    """A step of a small MLP (or a one-block LLaMA) and its workload."""
    w = zoo.llama_lm(layers=1, seq=8) if llama else zoo.mlp(features=64, hidden=128)
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=optimizer,
                      backend=backend), w  # fmt: skip


def test_int8_state_layout_and_bytes() -> None:
    step, _ = _compile(AdamW(lr=1e-3, state_dtype="int8"))
    state = step.optimizer_state()
    want = 8  # the learning rate and the step count, f32 scalars
    for param in step.graph.trainable_params:
        name, n = f"optim.exp_avg.{param.name}", param.type.numel
        if n >= MIN_8BIT_SIZE:  # a byte an element and an f32 absmax per 256, per moment
            assert state[f"{name}.codes"].dtype == np.uint8
            assert np.all(state[f"{name}.codes"] == ZERO_BYTE["signed"])
            assert state[f"{name}.absmax"].shape == (-(-n // 256),)
            want += 2 * (n + 4 * -(-n // 256))
        else:  # small params (biases) keep float32 moments
            assert state[name].dtype == np.float32
            want += 2 * 4 * n
    assert sum(v.nbytes for v in state.values()) == want
    assert step.report().ours.optimizer_state_bytes == want
    ops = [n.op for n in step.graph.nodes]
    assert "adamw8bit_update" in ops and "adamw_update" in ops


def _moments(state: dict[str, Array]) -> dict[str, Array]:
    """The optimizer state's moments as floats (8-bit ones dequantized)."""
    out = {}
    for name, value in state.items():
        if name.endswith(".codes"):
            base = name.removesuffix(".codes")
            code = SIGNED_CODE if ".exp_avg." in name else UNSIGNED_CODE
            out[base] = dequantize_blockwise(value, state[f"{base}.absmax"], code, 256)
        elif not name.endswith(".absmax"):
            out[name] = value
    return out


def test_torch_backend_equals_numpy_on_a_llama_block() -> None:
    opt = AdamW(lr=3e-3, state_dtype="int8")
    losses, moments = {}, {}
    for backend in ("numpy", "torch"):
        step, w = _compile(opt, backend, llama=True)
        losses[backend] = [step(*w.make_batch(0)) for _ in range(3)]
        moments[backend] = _moments(step.optimizer_state())
    np.testing.assert_allclose(losses["torch"], losses["numpy"], rtol=1e-5)
    assert moments["torch"].keys() == moments["numpy"].keys()
    for name, want in moments["numpy"].items():
        # float32 gradients differ in their last bits, so a byte may round the other way:
        # a code step is < 2% of the largest moment (and a float moment differs far less)
        bound = 0.04 * float(np.abs(want).max())
        np.testing.assert_allclose(moments["torch"][name], want, rtol=0, atol=bound)


def test_int8_state_tracks_float32_adamw() -> None:
    losses = {}
    for dtype in ("float32", "int8"):
        step, w = _compile(AdamW(lr=3e-3, state_dtype=dtype))
        losses[dtype] = [step(*w.make_batch(i % 4)) for i in range(12)]
    drop = losses["float32"][0] - losses["float32"][-1]
    assert drop > 0 and abs(losses["int8"][-1] - losses["float32"][-1]) < 0.05 * drop


def test_checkpoint_resume_round_trip_with_int8_state(tmp_path: Path) -> None:
    opt = AdamW(lr=3e-3, state_dtype="int8")
    straight, w = _compile(opt)
    want = [straight(*w.make_batch(i)) for i in range(4)]
    want_state = straight.optimizer_state()
    first, _ = _compile(opt)
    for i in range(2):
        first(*w.make_batch(i))
    params = {k: v for k, v in first.state_dict().items() if k in first.written}
    path = tmp_path / "ckpt.safetensors"
    ckpt_io.save(path, ckpt_io.Checkpoint(params, first.optimizer_state(), np.arange(3),
                                          {"step": 2}, {}, {}))  # fmt: skip
    saved = ckpt_io.load(path)
    assert any(v.dtype == np.uint8 for v in saved.optimizer.values())
    resumed = straight  # a step that has run on: everything it trains comes from the file
    resumed.load_state(saved.params, saved.optimizer, strict=False)
    got = [resumed(*w.make_batch(i)) for i in range(2, 4)]
    assert got == want[2:]  # bit for bit
    for name, value in want_state.items():
        np.testing.assert_array_equal(resumed.optimizer_state()[name], value, err_msg=name)


def test_bad_options_are_refused() -> None:
    with pytest.raises(CompileError, match="state_dtype"):
        AdamW(state_dtype="int4")
    with pytest.raises(CompileError, match="block"):
        AdamW(state_dtype="int8", block=0)
    with pytest.raises(FinetuneError, match="optimizer_state"):
        FinetuneConfig(optimizer_state="fp8").validate()
    with pytest.raises(FinetuneError, match="adamw"):
        FinetuneConfig(optimizer="sgd", optimizer_state="int8").validate()


def test_cli_option_reaches_the_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--optimizer-state", "int8"])
    assert config_from_args(args).optimizer_state == "int8"
    default = config_from_args(parser.parse_args([]))
    assert default.optimizer_state == "float32"
    assert "optimizer_state" in default.training_dict()  # resume insists on it
    opt = optimizer_of(config_from_args(args), lr=1e-3)  # what the estimates compile
    assert isinstance(opt, AdamW) and opt.state_dtype == "int8"
