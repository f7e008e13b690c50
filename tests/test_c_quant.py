"""Low-bit frozen weights in the C backend (``dequantize``, ``kernels/quant.c``).

- the kernel equals the NumPy reference bit for bit on every scheme, with f32 and GGUF's
  f16 scales (subnormal, infinite and NaN scales included);
- a LLaMA step whose frozen weights are GGUF blocks (Q8_0 tied embedding and LM head, Q4_0
  attention, Q4_1 MLP) trains in C as on the torch backend over 5 steps, in process and
  through the exported stand-alone ``./train``;
- f16 bits reach no op but ``dequantize`` and ``index`` (no arithmetic on the raw bits).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import claims
from pockengine.frontend.import_memo import reused_imports
from pockengine.ir import DType, GraphBuilder, Node, Role, TensorType, Value
from pockengine.ops.quant import Quantized, dequantize_array, quantize_int4, quantize_int8
from pockengine.sparse import schemes
from pockengine.tasks.gguf import decode_blocks
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

_LM_SPARSE = schemes.select(["*norm*", "*.o_proj.weight", "*down_proj*"])
# GGUF kind of each frozen matrix, by the module name's ending
_KINDS = {"embed_tokens": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0",
          "gate_proj": "Q4_1", "up_proj": "Q4_1"}  # fmt: skip


def _dequantize_in_c(q: Quantized) -> Array:
    """One ``dequantize`` node compiled by the C backend, run on ``q``'s arrays."""
    b = GraphBuilder("dq")
    names = ("codes", "scales", "offsets")[: len(q.arrays)]
    xs = [b.input(n, TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
          for n, a in zip(names, q.arrays, strict=True)]  # fmt: skip
    graph = b.build(b.call_multi("dequantize", *xs, source="test", scheme=q.scheme,
                                 group=q.group))  # fmt: skip
    assert all(claims(n) for n in graph.nodes)
    executable = pe.backends.c.CBackend().compile(graph)
    return executable.run({}, dict(zip(names, q.arrays, strict=True)))[0]


def _gguf(w: Array, kind: str) -> Quantized:
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(w.astype(np.float32), GGMLQuantizationType[kind])
    return decode_blocks(blocks, kind, w.shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int4", "int8", "int8-rows"])
def test_dequantize_kernel_equals_numpy_bit_for_bit(kind: str) -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 128)) * 0.02).astype(np.float32)
    if kind.startswith("Q"):
        q = _gguf(w, kind)
        special = np.array([2**-24, -(2**-20), np.inf, np.nan], dtype=np.float16)
        q.scales.reshape(-1)[:4] = special  # subnormal, infinite and NaN f16 scales
    else:
        q = {"int4": quantize_int4(w, 32), "int8": quantize_int8(w, 32)}.get(kind) or (
            quantize_int8(w)
        )
    with np.errstate(invalid="ignore"):  # inf * 0 in the reference: NaN, as in C
        want = dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme, group=q.group)
    got = _dequantize_in_c(q)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_half_bits_reach_only_dequantize_and_index() -> None:
    half = Value("s", TensorType((4, 2), DType.F16), Role.PARAM)
    ids = Value("i", TensorType((3,), DType.I64), Role.INPUT)
    rows = Value("r", TensorType((3, 2), DType.F16))
    assert claims(Node("index", (half, ids), (rows,), pe.ir.Attrs(axes=(0,)), "test"))
    assert not claims(Node("add", (half, half), (Value("z", half.type),), pe.ir.Attrs(), "t"))
    f32 = Value("f", TensorType((4, 2), DType.F32))
    assert not claims(Node("cast", (half,), (f32,), pe.ir.Attrs(dtype=DType.F32), "t"))


def _gguf_blocks(model: Any) -> dict[str, Quantized]:
    """The model's frozen matrices as GGUF blocks (``_KINDS``), by model name."""
    out = {}
    for name, p in model.named_parameters():
        kind = next((k for end, k in _KINDS.items() if f"{end}.weight" in name), None)
        if kind is not None:
            out[name] = _gguf(p.detach().numpy(), kind)
    return out


@dataclass
class _Trained:
    """The GGUF LLaMA's C and torch steps after 5 steps on the same batches, and the C
    step's trainer folder, exported before it trained."""

    c_step: pe.TrainStep
    torch_step: pe.TrainStep
    batches: list[Array]
    losses: dict[str, list[float]]
    folder: Path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> _Trained:
    w = zoo.llama_lm(layers=1, tied=True, vocab=4096)  # a vocabulary the fused loss takes
    kw: dict[str, Any] = {"scheme": _LM_SPARSE, "quantized": _gguf_blocks(w.model)}
    batch = w.make_batch(0)
    with reused_imports():  # one torch.export for both backends
        c_step, torch_step = (pe.compile(w.model, w.loss_fn, batch, backend=b,
                                         optimizer=pe.optim.AdamW(lr=1e-2), **kw)
                              for b in ("c", "torch"))  # fmt: skip
    folder = c_step.export(tmp_path_factory.mktemp("gguf") / "trainer", target="c")
    batches = [w.make_batch(i)[0].numpy() for i in range(5)]
    losses = {"c": [c_step(b) for b in batches], "torch": [torch_step(b) for b in batches]}
    return _Trained(c_step, torch_step, batches, losses, folder)


def test_gguf_llama_trains_in_c_as_on_torch(trained: _Trained) -> None:
    lowbit = ("dequantize", "dequantize_matmul")  # the C backend's products read the codes
    dq = [n for n in trained.c_step.graph.nodes if n.op in lowbit]
    assert {n.attrs["scheme"] for n in dq} == {"int8", "int4", "int4_sym"}
    assert any(v.dtype is DType.F16 for n in dq for v in n.inputs)
    np.testing.assert_allclose(trained.losses["c"], trained.losses["torch"], rtol=1e-5)
    ours, theirs = trained.c_step.state_dict(), trained.torch_step.state_dict()
    assert trained.c_step.trained
    for name in trained.c_step.trained:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-4, atol=5e-5, err_msg=name)


def test_exported_gguf_trainer_gives_the_in_process_losses(trained: _Trained) -> None:
    """``./train`` reads the i8/u8 codes and the f16 scales from its state file and gives
    the in-process C step's losses; built ``SMALL=1`` (-O2 with loops vectorised: the
    attention's exp among them) it prints the -O1 build's losses digit for digit."""
    folder = trained.folder
    np.save(folder / "ids.npy", np.stack(trained.batches))
    runs = []
    for flags in ("CFLAGS=-O1", "SMALL=1"):  # the -O1 kernels are shared, SMALL=1's are not
        if flags == "SMALL=1":
            subprocess.run(["make", "-s", "-B", "-C", str(folder), flags], check=True)
        else:
            make_trainer(folder, "-B", flags)
        runs.append(subprocess.run(["./train", "ids.npy"], cwd=folder, capture_output=True,
                                   text=True, check=True))  # fmt: skip
    got = [float(ln.split()[-1]) for ln in runs[0].stdout.splitlines() if ln.startswith("step ")]
    np.testing.assert_allclose(got, trained.losses["c"], rtol=1e-6)
    assert runs[1].stdout == runs[0].stdout
    timed = re.findall(r"^step (\d+) time ([\d.]+) s cpu ([\d.]+) s$", runs[1].stderr, re.M)
    assert [int(k) for k, _, _ in timed] == list(range(len(trained.batches))), runs[1].stderr
    assert all(float(wall) > 0 and float(cpu) > 0 for _, wall, cpu in timed)


def test_lora_on_int4_weights_trains_in_c_as_on_torch() -> None:
    """The issue's configuration in small: LoRA on q/v of a LLaMA whose frozen weights are
    int4 (float32 scales and offsets), AdamW; the C step follows the torch step."""
    w = zoo.llama_lm(layers=1, tied=True, vocab=4096)
    kw: dict[str, Any] = {"scheme": pe.schemes.lora(rank=4, alpha=8, targets=["*q_proj",
                          "*v_proj"]), "frozen_dtype": "int4"}  # fmt: skip
    batch = w.make_batch(0)
    with reused_imports():  # one torch.export for both backends
        c_step, torch_step = (pe.compile(w.model, w.loss_fn, batch, backend=b,
                                         optimizer=pe.optim.AdamW(lr=1e-2), **kw)
                              for b in ("c", "torch"))  # fmt: skip
    assert any(n.op == "dequantize" for n in c_step.graph.nodes)
    assert c_step.trained and all(".lora_" in n for n in c_step.trained)
    for i in range(5):
        batch = w.make_batch(i)
        assert c_step(*batch) == pytest.approx(torch_step(*batch), rel=1e-5), i
