"""The torch backend's dropout masks (``backends.torch.kernels_rng``).

- the int32 counter hash gives the NumPy reference's ``random_mask`` bit for bit: across
  chunk edges, in a last partial chunk, at p = 0 and p = 1, for seeds of all 64 bits;
- a dropout's ``ne(random_mask, 0)`` is made by the mask's kernel as a bool keep-mask and
  the float32 mask is never made, unless another node reads it; either way the step
  gives the NumPy backend's results bit for bit.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.backends.torch import kernels_rng as rng
from pockengine.backends.torch.backend import TorchBackend
from pockengine.ir import DType, Graph, GraphBuilder, Role, TensorType, get_op

_SEEDS = (0, -12345, 2**40 + 7, -(2**63), 2**63 - 1)


def _reference(seed: int, shape: tuple[int, ...], p: float, salt: int) -> np.ndarray:
    kernel = get_op("random_mask").kernel
    out: np.ndarray = kernel(np.asarray(seed, dtype=np.int64), shape=shape, p=p, salt=salt)
    return out


@pytest.mark.parametrize("seed", _SEEDS)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_masks_are_the_reference_bit_for_bit(seed: int, p: float) -> None:
    shape = (3, rng.MASK_CHUNK // 2 + 7)  # two chunk edges and a partial last chunk
    salt = 2**33 + 5
    assert math.prod(shape) % rng.MASK_CHUNK
    args = (torch.tensor(seed, dtype=torch.int64), rng.mix_int(salt & 0xFFFFFFFF))
    threshold = math.ceil(p * 2.0**32)
    scale = float(np.float32(1 / (1 - p) if p < 1 else 0.0))
    want = _reference(seed, shape, p, salt)
    mask = rng.random_mask(*args, threshold, scale, shape)
    keep = rng.random_keep(*args, threshold, shape)
    np.testing.assert_array_equal(mask.numpy(), want)
    assert keep.dtype == torch.bool
    np.testing.assert_array_equal(keep.numpy(), want != 0)


def _dropout_graph(read_mask: bool) -> Graph:
    """y = where(ne(m, 0), x * 2, 0) with m = random_mask(seed, p=0.5) (a dropout as the
    frontends lower it); with ``read_mask`` also y + x * m, which reads the float mask."""
    b = GraphBuilder("drop")
    x = b.input("x", TensorType((5, 37), DType.F32), Role.INPUT)
    seed = b.input("seed", TensorType((), DType.I64), Role.STATE)
    m = b.call("random_mask", seed, shape=(5, 37), p=0.5, salt=3)
    zero = b.call("full", shape=(), value=0.0, dtype="f32")
    two = b.call("full", shape=(), value=2.0, dtype="f32")
    keep = b.call("ne", m, zero)
    y = b.call("where", keep, b.call("mul", x, two), zero)
    if read_mask:
        y = b.call("add", y, b.call("mul", x, m))
    return b.build([y, keep])


@pytest.mark.parametrize("read_mask", [False, True])
def test_a_dropout_keep_mask_is_fused_into_its_random_mask(read_mask: bool) -> None:
    graph = _dropout_graph(read_mask)
    store = {
        "x": np.random.default_rng(0).standard_normal((5, 37)).astype(np.float32),
        "seed": np.asarray(987654321987, dtype=np.int64),
    }
    exe = TorchBackend().compile(graph)
    code = "\n".join(line.split("  # ", 1)[0] for line in exe.source.splitlines())
    assert re.search(r"(h\d+) = random_keep\(", code)
    assert "aten_ne(" not in code
    assert ("random_mask(" in code) is False  # the float mask is made from the keep ...
    assert ("aten_mul(h" in code) is read_mask  # ... only where something reads it
    want = NumpyBackend().compile(graph).run(dict(store))
    got = exe.run({k: torch.from_numpy(v) for k, v in store.items()})
    for g, w in zip(got, want, strict=True):
        assert g.numpy().dtype == w.dtype
        np.testing.assert_array_equal(g.numpy(), w)
    assert 0 < want[1].sum() < want[1].size


def test_a_ne_of_another_value_is_a_plain_comparison() -> None:
    b = GraphBuilder("cmp")
    x = b.input("x", TensorType((4,), DType.F32), Role.INPUT)
    seed = b.input("seed", TensorType((), DType.I64), Role.STATE)
    m = b.call("random_mask", seed, shape=(4,), p=0.5, salt=1)
    one = b.call("full", shape=(), value=1.0, dtype="f32")
    graph = b.build([b.call("ne", x, b.call("full", shape=(), value=0.0, dtype="f32")),
                     b.call("ne", m, one)])  # fmt: skip
    code = TorchBackend().compile(graph).source
    assert "random_keep(" not in code and code.count("aten_ne(") == 2
    store = {"x": np.asarray([0, 1, -0.0, 2], np.float32), "seed": np.asarray(5, np.int64)}
    want = NumpyBackend().compile(graph).run(dict(store))
    got = TorchBackend().compile(graph).run({k: torch.from_numpy(v) for k, v in store.items()})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w)


@pytest.mark.parametrize("budget", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_lora_step_with_dropout_trains_as_the_numpy_backend(budget: bool) -> None:
    """A small BERT with dropout, LoRA on q/v plus the head, three AdamW steps: the torch
    step (keep-masks fused, and recomputed in the backward under a budget) matches the
    NumPy backend within float32 tolerance."""
    import pockengine as pe
    from pockengine import schemes
    from pockengine.zoo import bert_classifier

    w = bert_classifier(layers=1, hidden=32, heads=4, ffn=48, vocab=64, seq=8, classes=3,
                        dropout=0.3)  # fmt: skip

    def compile_for(backend: str, limit: int | None = None) -> pe.TrainStep:
        return pe.compile(w.model, w.loss_fn, w.make_batch(0), backend=backend,
                          scheme=schemes.lora(4, 8) | schemes.head(), memory_budget=limit,
                          optimizer=pe.optim.AdamW(lr=1e-2))  # fmt: skip

    limit = compile_for("numpy").report().ours.planned_peak_bytes * 9 // 10 if budget else None
    ref, ours = compile_for("numpy", limit), compile_for("torch", limit)
    code = "\n".join(line.split("  # ", 1)[0] for line in ours._exec.source.splitlines())
    assert code.count("random_keep(") >= 3 and "random_mask(" not in code
    if budget:
        assert ours.report().recomputation is not None
    for i in range(3):
        np.testing.assert_allclose(ours(*w.make_batch(i)), ref(*w.make_batch(i)), rtol=1e-5)
    got, want = ours.flat_state_dict(), ref.flat_state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
