"""Products with low-bit frozen matrices inside the C GEMM (``dequantize_matmul``,
``backends/c/fuse_lowbit.py``, ``kernels/lowbit_gemm.c``).

- ``X W^T`` and ``dY W`` with W in every scheme (GGUF Q4_0/Q4_1/Q8_0 with f16 scales, our
  int4/int8 groups, int8 per row), at shapes with partial panels, partial slivers, k
  blocks and groups cut by the blocking: bit for bit the C GEMM on the float matrix that
  ``dequantize`` makes, and the NumPy backend's dequantize + matmul to float32 rounding;
- ``tests/c_kernels/lowbit_check.c``: the kernel against ``pe_gemm`` on ``pe_dequantize``'s
  matrix, bit for bit, every scheme, f16 and float scales, groups of 32, 64 and a row, both
  orientations, accumulating, a first row other than 0, float and double; built with the
  backend's flags, for AVX2, portable, and for aarch64 (NEON) run under qemu;
- a LLaMA LoRA step on int4 weights: its C executable holds no float copy of a frozen
  matrix (no ``dequantize`` of a matrix, no transpose of one), its arena is smaller than
  the unfused plan's, and it trains as the torch backend does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.c import CBackend
from pockengine.backends.c.driver import toolchain
from pockengine.backends.c.fuse_lowbit import fuse_lowbit_products
from pockengine.ir import DType, GraphBuilder, Role, TensorType
from pockengine.ops.quant import Quantized, dequantize_array, quantize_int4, quantize_int8
from pockengine.plan import plan_memory
from pockengine.tasks.gguf import decode_blocks
from tests.c_check import run_check, run_check_aarch64

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ["Q4_0", "Q4_1", "Q8_0", "int4", "int8", "int8-rows"]


def _quantized(w: Array, kind: str) -> Quantized:
    if kind.startswith("Q"):
        from gguf import GGMLQuantizationType, quants

        blocks = quants.quantize(w, GGMLQuantizationType[kind])
        return decode_blocks(blocks, kind, w.shape)
    if kind == "int4":
        return quantize_int4(w, 32)
    return quantize_int8(w, 32 if kind == "int8" else None)


def _product(x: Array, dense: Array, q: Quantized | None, transpose: bool) -> Array:
    """``x @ W^T`` or ``x @ W`` compiled by the C backend: W dequantized from ``q`` in the
    graph, or (``q`` None) given as the float input ``dense``."""
    b = GraphBuilder("product")
    xv = b.input("x", TensorType(x.shape, DType.F32), Role.INPUT)
    feeds: dict[str, Array] = {"x": x}
    if q is None:
        w = b.input("w", TensorType(dense.shape, DType.F32), Role.INPUT)
        feeds["w"] = dense
    else:
        names = ("codes", "scales", "offsets")[: len(q.arrays)]
        qs = [b.input(n, TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
              for n, a in zip(names, q.arrays, strict=True)]  # fmt: skip
        feeds.update(zip(names, q.arrays, strict=True))
        w = b.call("dequantize", *qs, scheme=q.scheme, group=q.group)
    y = b.call("transpose", w, perm=(1, 0)) if transpose else w
    graph = b.build([b.call("matmul", xv, y)])
    executable = CBackend().compile(graph)
    fused = q is not None
    assert [n.op for n in executable.graph.nodes] == (
        ["dequantize_matmul"] if fused else ["transpose", "matmul"][1 - transpose :]
    )
    return executable.run({}, feeds)[0]


@pytest.mark.parametrize("transpose", [True, False], ids=["xWT", "dYW"])
@pytest.mark.parametrize("kind", KINDS)
def test_lowbit_product_equals_the_gemm_on_the_dequantized_matrix(
    kind: str, transpose: bool
) -> None:
    rng = np.random.default_rng(7)
    rows, cols = 37, 320  # partial slivers and panels; a k block and groups cut at 256
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    q = _quantized(w, kind)
    dense = dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme, group=q.group)
    m = 19
    x = rng.standard_normal((m, cols if transpose else rows)).astype(np.float32)
    got = _product(x, dense, q, transpose)
    want = _product(x, dense, None, transpose)  # the same GEMM on the float matrix
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    ref = x @ (dense.T if transpose else dense)  # the NumPy backend's dequantize + matmul
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_numpy_reference_of_dequantize_matmul_is_the_unfused_product() -> None:
    rng = np.random.default_rng(1)
    q = quantize_int4(rng.standard_normal((6, 64)).astype(np.float32), 32)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    b = GraphBuilder("ref")
    xv = b.input("x", TensorType(x.shape, DType.F32), Role.INPUT)
    names = ("codes", "scales", "offsets")
    qs = [b.input(n, TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
          for n, a in zip(names, q.arrays, strict=True)]  # fmt: skip
    w = b.call("dequantize", *qs, scheme="int4", group=32)
    graph = b.build([b.call("matmul", xv, b.call("transpose", w, perm=(1, 0)))])
    fused = fuse_lowbit_products(graph)
    assert [n.op for n in fused.nodes] == ["dequantize_matmul"]
    feeds = {"x": x, **dict(zip(names, q.arrays, strict=True))}
    numpy = get_backend("numpy")
    (a,) = numpy.compile(graph).run({}, feeds)
    (b2,) = numpy.compile(fused).run({}, feeds)
    np.testing.assert_array_equal(a, b2)


_KINDS = {"embed_tokens": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0",
          "o_proj": "Q4_1", "gate_proj": "Q4_1", "up_proj": "Q4_1",
          "down_proj": "Q8_0"}  # fmt: skip


def _gguf_blocks(model: Any) -> dict[str, Quantized]:
    out = {}
    for name, p in model.named_parameters():
        kind = next((k for end, k in _KINDS.items() if f"{end}.weight" in name), None)
        if kind is not None:
            out[name] = _quantized(p.detach().numpy(), kind)
    return out


@pytest.mark.parametrize("weights", ["int4", "gguf"])
def test_lora_step_on_lowbit_weights_holds_no_float_matrix(weights: str) -> None:
    """LoRA r4 on q/v of a tied LLaMA whose vocabulary (8192) takes the fused loss head:
    int4 groups with float scales, or GGUF blocks (Q8_0 table, Q4_0/Q4_1/Q8_0 matrices, f16
    scales). The C executable's products and loss head read the codes (no float matrix in
    the plan), and the step trains as the torch backend's does."""
    w = zoo.llama_lm(layers=1, tied=True, vocab=8192)
    scheme = pe.schemes.lora(rank=4, alpha=8, targets=["*q_proj", "*v_proj"])
    kw: dict[str, Any] = {"scheme": scheme}
    if weights == "int4":
        kw["frozen_dtype"] = "int4"
    else:
        kw["quantized"] = _gguf_blocks(w.model)
    batch = w.make_batch(0)
    c_step, torch_step = (pe.compile(w.model, w.loss_fn, batch, backend=b,
                                     optimizer=pe.optim.AdamW(lr=1e-2), **kw)
                          for b in ("c", "torch"))  # fmt: skip
    executable = c_step._exec
    # the pipeline ran the C backend's rewrite, so a memory budget plans what C runs
    assert executable.graph.nodes == c_step.graph.nodes
    nodes = executable.graph.nodes
    ops = [n.op for n in nodes]
    assert "dequantize_linear_log_softmax_gather_with_grad" in ops  # the tied head's table
    products = [n for n in nodes if n.op == "dequantize_matmul"]
    # X W^T of the 7 block matrices; dY W back to the LoRA of q/v: down, up, gate, o
    assert sum(n.attrs["transpose"] for n in products) == 7
    assert sum(not n.attrs["transpose"] for n in products) == 4
    assert all(n.outputs[0].type.rank > 2 for n in nodes if n.op == "dequantize")  # rows only
    unfused = plan_memory(torch_step.graph).arena_bytes  # the same pipeline, unfused
    table = 8192 * 64 * 4  # the float table, in the unfused plan
    assert executable.plan.arena_bytes < table // 4 < unfused  # 0.14 of 2.1 MiB
    for i in range(3):
        batch = w.make_batch(i)
        assert c_step(*batch) == pytest.approx(torch_step(*batch), rel=1e-5), i


KERNELS = ("linalg.c", "lowbit_gemm.c", "quant.c", "loss.c", "loss_once.c", "common.c")


def test_lowbit_gemm_kernel_with_the_backend_flags(tmp_path: Path) -> None:
    run_check(tmp_path, "lowbit_check.c", KERNELS, list(toolchain().flags), least=400)


def test_lowbit_gemm_kernel_avx2_and_portable(tmp_path: Path) -> None:
    cpu = Path("/proc/cpuinfo")
    if {"avx2", "fma"} <= set(cpu.read_text().split() if cpu.exists() else ()):
        flags = ["-O3", "-march=native", "-mno-avx512f", "-fopenmp"]
        run_check(tmp_path, "lowbit_check.c", KERNELS, flags, least=400)
    run_check(tmp_path, "lowbit_check.c", KERNELS, ["-O3", "-DPE_GEMM_PORTABLE"], least=400)


def test_lowbit_gemm_kernel_neon_under_qemu(tmp_path: Path) -> None:
    run_check_aarch64(tmp_path, "lowbit_check.c", KERNELS, least=300, args=("quick",))
