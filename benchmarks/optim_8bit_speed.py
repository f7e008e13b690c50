"""One AdamW update of a float32 param, 8-bit block-wise state against float32 state, on
the torch and C backends.

    OMP_NUM_THREADS=1 python benchmarks/optim_8bit_speed.py --rows 576 --cols 1536 --rounds 50

Four updates of the same ``[rows, cols]`` param (smollm2's ``down_proj`` by default):
``adamw8bit_update`` by the torch kernel (``backends.torch.kernels_optim.adamw8bit_``) and by the C
kernel (``pe_adamw8bit_f32`` through a one-node compiled graph), and the float32 baseline
of each (ATen's fused AdamW, ``pe_adamw_f32``). One thread each (torch and OpenMP). Prints
the median and best wall milliseconds an update and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pockengine.backends.c import CBackend
from pockengine.backends.torch.kernels_optim import adamw8bit_
from pockengine.ir import DType, GraphBuilder, Role, TensorType
from pockengine.ops.update_8bit import SIGNED_CODE, UNSIGNED_CODE, quantize_blockwise

Array = np.ndarray[Any, Any]
HYPER: dict[str, Any] = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BLOCK = 256


def _state(rows: int, cols: int) -> dict[str, Array]:
    rng = np.random.default_rng(0)
    w, g = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2))
    m = (0.01 * rng.standard_normal((rows, cols))).astype(np.float32)
    root = (0.01 * rng.random((rows, cols))).astype(np.float32)
    mq, ma = quantize_blockwise(m, SIGNED_CODE, BLOCK)
    vq, va = quantize_blockwise(root, UNSIGNED_CODE, BLOCK)
    t, lr = np.asarray(3.0, np.float32), np.asarray(1e-3, np.float32)
    return {"w": w, "g": g, "mq": mq, "ma": ma, "vq": vq, "va": va, "t": t, "lr": lr,
            "m": m, "v": root * root}  # fmt: skip


def _c_update(state: dict[str, Array], low_bit: bool) -> Callable[[], None]:
    names = ("w", "g", "mq", "ma", "vq", "va") if low_bit else ("w", "g", "m", "v")
    b = GraphBuilder("update")
    xs = [
        b.input(k, TensorType(state[k].shape, DType.from_numpy(state[k].dtype)),
                Role.INPUT if k == "g" else Role.STATE)
        for k in (*names, "t", "lr")
    ]  # fmt: skip
    extra: dict[str, Any] = {"block": BLOCK} if low_bit else {}
    op = "adamw8bit_update" if low_bit else "adamw_update"
    b.call_multi(op, *xs, source="bench", **HYPER, **extra)
    step = CBackend(threads=1).compile(b.build([]))
    store = {k: np.array(state[k]) for k in (*names, "t", "lr")}

    def update() -> None:
        step.run(store, {})

    return update


def _torch_update(state: dict[str, Array], low_bit: bool) -> Callable[[], None]:
    ts = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}
    beta1, beta2, eps, weight_decay = (HYPER[k] for k in ("beta1", "beta2", "eps", "weight_decay"))

    def low() -> None:
        w, g, mq, ma, vq, va, t, lr = (ts[k] for k in ("w", "g", "mq", "ma", "vq", "va", "t", "lr"))
        adamw8bit_(w, g, mq, ma, vq, va, t, lr, None, (beta1, beta2, eps, weight_decay), BLOCK)

    def full() -> None:
        torch._fused_adamw_([ts["w"]], [ts["g"]], [ts["m"]], [ts["v"]], [], [ts["t"]],
                            lr=ts["lr"], beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                            eps=eps, amsgrad=False, maximize=False)  # fmt: skip

    return low if low_bit else full


def _time(update: Callable[[], None], rounds: int) -> tuple[float, float]:
    update()  # warm up (the C step's first run also trims the heap)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        update()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=576)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = _state(args.rows, args.cols)
    results = {}
    for backend, make in (("torch", _torch_update), ("c", _c_update)):
        for low_bit in (True, False):
            label = f"{backend} {'int8' if low_bit else 'float32'}"
            median, best = _time(make(state, low_bit), args.rounds)
            results[label] = {"median_ms": round(median, 3), "best_ms": round(best, 3)}
            print(f"{label:14s} median {median:8.3f} ms  best {best:8.3f} ms")
    print(json.dumps({"rows": args.rows, "cols": args.cols, "results": results}))


if __name__ == "__main__":
    main()
