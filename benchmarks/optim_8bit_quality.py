"""How far 8-bit AdamW state moves the weights from float32 AdamW's, by code and layout.

    python benchmarks/optim_8bit_quality.py [--steps 200]          # docs/quant.md

The same gradient sequence drives float32 AdamW and AdamW whose moments are stored
block-wise in 8 bits (blocks of 256, absmax scale) with a given code, and prints the
distance of each quantized run's weights from the float32 run's, relative to how far the
float32 run moved them. The gradients are synthetic but shaped like a language model's
weight gradients: every element has its own scale, log-uniform over three decades, so a
block's second moments span six, plus noise around a slowly drifting mean.

Stores: ``dynamic-sqrt-v`` is what ``AdamW(state_dtype="int8")`` stores: bitsandbytes'
dynamic tree codes, signed for m and unsigned for sqrt(v); ``dynamic-v`` stores v itself
with the unsigned code (bitsandbytes' 8-bit Adam); ``linear`` is 256 evenly spaced levels
(symmetric for m, [0, 1] for v), ``linear-sqrt-v`` the same with sqrt(v). ``--spread
rows`` gives each row one scale (mild: a block's elements alike) instead of each element.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pockengine.ops.update_8bit import (
    SIGNED_CODE,
    UNSIGNED_CODE,
    dequantize_blockwise,
    quantize_blockwise,
)

Array = np.ndarray[Any, Any]
BLOCK = 256
B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-3, 0.01
LINEAR_SIGNED = np.linspace(-1, 1, 256, dtype=np.float32)
LINEAR_UNSIGNED = np.linspace(0, 1, 256, dtype=np.float32)


def _roundtrip(code: Array) -> Callable[[Array], Array]:
    def store(x: Array) -> Array:
        return dequantize_blockwise(*quantize_blockwise(x, code, BLOCK), code, BLOCK)

    return store


def _sqrt_store(code: Array) -> Callable[[Array], Array]:
    inner = _roundtrip(code)
    return lambda v: np.square(inner(np.sqrt(v)))


STORES: dict[str, tuple[Callable[[Array], Array], Callable[[Array], Array]]] = {
    "float32": (lambda m: m, lambda v: v),
    "dynamic-sqrt-v": (_roundtrip(SIGNED_CODE), _sqrt_store(UNSIGNED_CODE)),
    "dynamic-v": (_roundtrip(SIGNED_CODE), _roundtrip(UNSIGNED_CODE)),
    "linear": (_roundtrip(LINEAR_SIGNED), _roundtrip(LINEAR_UNSIGNED)),
    "linear-sqrt-v": (_roundtrip(LINEAR_SIGNED), _sqrt_store(LINEAR_UNSIGNED)),
}


def _gradients(steps: int, shape: tuple[int, int], spread: str, seed: int) -> list[Array]:
    rng = np.random.default_rng(seed)
    scale_shape = shape if spread == "elements" else (shape[0], 1)
    scale = np.exp(rng.uniform(math.log(1e-5), math.log(1e-2), scale_shape)).astype(np.float32)
    mean = rng.standard_normal(shape).astype(np.float32)
    out = []
    for _ in range(steps):
        mean += 0.05 * rng.standard_normal(shape).astype(np.float32)
        out.append(scale * (0.3 * mean + rng.standard_normal(shape).astype(np.float32)))
    return out


def _run(name: str, w0: Array, grads: list[Array]) -> Array:
    store_m, store_v = STORES[name]
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        m = store_m(B1 * m + (1 - B1) * g)  # the stored moments are what the next step reads
        v_new = B2 * v + (1 - B2) * g * g
        denom = np.sqrt(v_new) / math.sqrt(1 - B2**t) + EPS
        w = w * (1 - LR * WD) - LR / (1 - B1**t) * m / denom
        v = store_v(v_new)
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--spread", choices=("elements", "rows"), default="elements")
    args = p.parse_args()
    grads = _gradients(args.steps, (args.rows, args.cols), args.spread, seed=0)
    w0 = np.random.default_rng(1).standard_normal((args.rows, args.cols)).astype(np.float32)
    reference = _run("float32", w0, grads)
    moved = float(np.linalg.norm(reference - w0))
    print(f"{args.steps} steps, {args.rows}x{args.cols}, blocks of {BLOCK}, scale per "
          f"{args.spread[:-1]}")  # fmt: skip
    print(f"{'moments':<16}{'|w - w_f32| / |w_f32 - w0|':>30}{'max |dw - dw_f32| / lr':>26}")
    for name in ("dynamic-sqrt-v", "dynamic-v", "linear", "linear-sqrt-v"):
        w = _run(name, w0, grads)
        rel = float(np.linalg.norm(w - reference)) / moved
        worst = float(np.abs(w - reference).max()) / LR
        print(f"{name:<16}{rel:>30.4f}{worst:>26.1f}")


if __name__ == "__main__":
    main()
