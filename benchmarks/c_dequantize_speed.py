"""The C ``dequantize`` kernel beside the NumPy reference, one thread.

An [8192, 512] float32 matrix as our int4 (f32 scales and offsets), GGUF Q4_0 and Q8_0
(f16 scales): one ``dequantize`` node compiled by the C backend (``PE_C_OPENMP=0``), the
median of 20 calls, and the NumPy reference's.

    python benchmarks/c_dequantize_speed.py
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

os.environ.setdefault("PE_C_OPENMP", "0")


def _seconds(call: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _case(label: str, q: Any) -> None:
    from pockengine.backends.c import CBackend
    from pockengine.ir import DType, GraphBuilder, Role, TensorType
    from pockengine.ops.quant import dequantize_array

    b = GraphBuilder("dq")
    names = ("codes", "scales", "offsets")[: len(q.arrays)]
    xs = [b.input(n, TensorType(a.shape, DType.from_numpy(a.dtype)), Role.INPUT)
          for n, a in zip(names, q.arrays, strict=True)]  # fmt: skip
    graph = b.build(b.call_multi("dequantize", *xs, source="bench", scheme=q.scheme,
                                 group=q.group))  # fmt: skip
    executable = CBackend().compile(graph)  # owns the arena and the library: kept alive
    bound = executable.bind({}, dict(zip(names, q.arrays, strict=True)))
    c = _seconds(lambda: bound.function(bound.arena, bound.args), 20)
    ref = _seconds(lambda: dequantize_array(q.codes, q.scales, q.offsets, scheme=q.scheme,
                                            group=q.group), 3)  # fmt: skip
    size = graph.outputs[0].type.numel
    del executable
    print(f"{label}: C {c * 1e3:.2f} ms ({size / c / 1e9:.2f} G elements/s), "
          f"NumPy {ref * 1e3:.2f} ms")  # fmt: skip


def main() -> None:
    from gguf import GGMLQuantizationType, quants

    from pockengine.ops.quant import quantize_int4
    from pockengine.tasks.gguf import decode_blocks

    w = (np.random.default_rng(0).standard_normal((8192, 512)) * 0.02).astype(np.float32)

    def gguf(kind: str) -> Any:
        return decode_blocks(quants.quantize(w, GGMLQuantizationType[kind]), kind, w.shape)

    _case("int4 (f32)", quantize_int4(w, 32))
    _case("Q4_0 (f16)", gguf("Q4_0"))
    _case("Q8_0 (f16)", gguf("Q8_0"))


if __name__ == "__main__":
    main()
