"""The C backend's ``adamw8bit_update`` (kernels/update.c) against the NumPy reference.

- the code tables written into kernels/code8.h are ``SIGNED_CODE`` and ``UNSIGNED_CODE``;
- round-to-nearest on every midpoint of both codes and on its float32 neighbours, zeros,
  tiny values and NaN gives the reference's bytes (beta1 = beta2 = 0 makes the stored m
  and sqrt(v) the gradient), and the float32 bins' conditions hold for both codes;
- float32 updates, with partial-channel ``rows``, a short last block and a zero block,
  repeated: the same bytes as NumPy, weights and absmax to float32 rounding;
- an MLP with ``AdamW(state_dtype="int8")`` trains as on NumPy, and its exported trainer
  builds with ``make`` and gives the in-process losses and state.
(The float64 op samples are checked with every other op's in tests/test_c_backend.py.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend
from pockengine.backends.c.driver import KERNEL_DIR
from pockengine.backends.c.export import read_safetensors
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import DType, Graph, GraphBuilder, Role, TensorType
from pockengine.ops.update_8bit import (
    SIGNED_CODE,
    UNSIGNED_CODE,
    code_bins,
    code_midpoints,
    quantize_blockwise,
)
from pockengine.optim import AdamW
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip
NAMES = ("w", "g", "mq", "ma", "vq", "va", "t", "lr")


def _c_table(text: str, name: str) -> Array:
    body = re.search(rf"{name}\[256\] = \{{(.*?)\}};", text, re.S)
    assert body is not None, name
    values = [float.fromhex(v.strip().removesuffix("f")) for v in body.group(1).split(",")[:-1]]
    return np.asarray(values, dtype=np.float64)


def test_code_tables_are_the_references() -> None:
    text = (KERNEL_DIR / "code8.h").read_text()
    for name, code in (("PE_SIGNED_CODE", SIGNED_CODE), ("PE_UNSIGNED_CODE", UNSIGNED_CODE)):
        np.testing.assert_array_equal(_c_table(text, name), code.astype(np.float64), name)


def _update_graph(state: dict[str, Array], rows: int | None, **attrs: Any) -> Graph:
    b = GraphBuilder("adamw8bit")
    xs = [
        b.input(k, TensorType(state[k].shape, DType.from_numpy(state[k].dtype)),
                Role.STATE if k in ("w", "mq", "ma", "vq", "va") else Role.INPUT)
        for k in NAMES
    ]  # fmt: skip
    b.call_multi("adamw8bit_update", *xs, source="test", rows=rows, **attrs)
    return b.build([])


def _run_both(
    state: dict[str, Array], steps: int = 1, rows: int | None = None, **attrs: Any
) -> tuple[dict[str, Array], dict[str, Array]]:
    """``steps`` updates of ``state`` on C and on NumPy: the two final states."""
    graph = _update_graph(state, rows, **attrs)
    stores = {k: {n: np.array(a) for n, a in state.items()} for k in ("c", "numpy")}
    c_step, np_step = CBackend().compile(graph), NumpyBackend().compile(graph)
    for k in range(steps):
        for store in stores.values():
            store["t"] = np.asarray(k + 1.0, np.float32)
        c_step.run(stores["c"], {})
        np_step.run(stores["numpy"])
    return stores["c"], stores["numpy"]


def _state(w: Array, g: Array, block: int, scale: float = 0.1) -> dict[str, Array]:
    rng = np.random.default_rng(1)
    m = np.asarray(scale * rng.standard_normal(g.shape), dtype=np.float32)
    root = np.asarray(scale * rng.random(g.shape), dtype=np.float32)
    m.reshape(-1)[:block] = root.reshape(-1)[:block] = 0.0  # a block of zeros (absmax 0)
    mq, ma = quantize_blockwise(m, SIGNED_CODE, block)
    vq, va = quantize_blockwise(root, UNSIGNED_CODE, block)
    t, lr = np.asarray(1.0, np.float32), np.asarray(1e-2, np.float32)
    return dict(zip(NAMES, (w, g, mq, ma, vq, va, t, lr), strict=True))


def _assert_same(got: dict[str, Array], want: dict[str, Array]) -> None:
    for name in ("mq", "vq"):  # the bytes: equal
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("w", "ma", "va"):  # floats: to float32 rounding
        np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=1e-9, err_msg=name)


def test_rounding_on_every_midpoint_and_its_neighbours() -> None:
    """With beta1 = beta2 = 0 the new m is g and the new sqrt(v) is |g|; each block holds
    a 1.0 (absmax 1), so the kernel rounds exactly the codes' midpoints and neighbours,
    zeros, values below every midpoint's magnitude (where the float32 bins clamp) and NaN."""
    values = []
    for code in (SIGNED_CODE, UNSIGNED_CODE):
        mids = code_midpoints(code)
        values += [mids, np.nextafter(mids, np.float32(-2)), np.nextafter(mids, np.float32(2))]
    tiny = np.float32(2.0**-23)
    values.append(np.asarray([0.0, -0.0, 1e-30, -1e-30, tiny, -tiny, 2 * tiny, np.nan, -np.nan]))
    g = np.concatenate(values).astype(np.float32)
    block = 255
    g = np.insert(g, np.arange(0, g.size, block - 1), np.float32(1.0))[None, :]
    state = _state(np.ones_like(g), g, block)
    hyper: dict[str, Any] = {"beta1": 0.0, "beta2": 0.0, "eps": 1e-8, "weight_decay": 0.0}
    got, want = _run_both(state, block=block, **hyper)
    _assert_same(got, want)
    assert len(np.unique(got["mq"])) > 200 and len(np.unique(got["vq"])) > 100


def test_float32_bins_are_exact_for_both_codes() -> None:
    """The kernel's float32 path (code8.h) counts one midpoint a bin and clamps magnitudes
    below 2^-23: exact only while no bin holds two midpoints and none lies that low."""
    for code in (SIGNED_CODE, UNSIGNED_CODE):
        assert code_bins(code)[1] == 1
        assert np.abs(code_midpoints(code)).min() > 2.0**-23


@pytest.mark.parametrize("rows", [None, 5])
def test_float32_updates_equal_numpy(rows: int | None) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 300)).astype(np.float32)
    g = rng.standard_normal((rows or 7, 300)).astype(np.float32)
    g[0] *= 1e-3  # scales differ within blocks
    hyper: dict[str, Any] = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    got, want = _run_both(_state(w, g, 256), steps=4, rows=rows, block=256, **hyper)
    _assert_same(got, want)
    if rows is not None:  # the untrained rows are untouched
        np.testing.assert_array_equal(got["w"][rows:], w[rows:])


# -- a whole model, in process and as the stand-alone trainer ----------------------------------
def _mlp_step(backend: str) -> tuple[Any, zoo.Workload]:
    w = zoo.mlp(features=64, hidden=128)
    optimizer = AdamW(lr=3e-3, state_dtype="int8")
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=optimizer,
                      backend=backend), w  # fmt: skip


def test_mlp_with_int8_state_trains_as_on_numpy() -> None:
    (ours, w), (ref, _) = _mlp_step("c"), _mlp_step("numpy")
    assert "adamw8bit_update" in [n.op for n in ours.graph.nodes]
    for i in range(4):
        batch = w.make_batch(i)
        assert ours(*batch) == pytest.approx(ref(*batch), rel=1e-5)
    got, want = ours.optimizer_state(), ref.optimizer_state()
    assert got.keys() == want.keys()
    for name, value in want.items():
        if value.dtype == np.uint8:  # float32 gradients differ in their last bits
            assert np.mean(got[name] != value) < 0.01, name
        else:
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-6, err_msg=name)


def test_exported_trainer_with_int8_state_matches_in_process(tmp_path: Path) -> None:
    step, w = _mlp_step("c")
    folder = step.export(tmp_path / "trainer", target="c")
    batches = [w.make_batch(i) for i in range(3)]
    for k, name in enumerate(("X", "Y")):
        np.save(folder / f"{name}.npy", np.stack([b[k].numpy() for b in batches]))
    losses = [step(*b) for b in batches]
    make_trainer(folder)
    run = subprocess.run(["./train", "--save", "out.safetensors", "X.npy", "Y.npy"],
                         cwd=folder, capture_output=True, text=True, check=True)  # fmt: skip
    got = [float(ln.split()[-1]) for ln in run.stdout.splitlines() if ln.startswith("step ")]
    np.testing.assert_allclose(got, losses, rtol=1e-6)
    saved = read_safetensors(folder / "out.safetensors")
    state = step.optimizer_state()
    codes = [k for k, v in state.items() if v.dtype == np.uint8]
    assert codes and all(saved[k].dtype == np.uint8 for k in codes)
    for name, value in state.items():
        if name in codes:
            assert np.mean(saved[name] != value) < 0.01, name
        else:
            np.testing.assert_allclose(saved[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
