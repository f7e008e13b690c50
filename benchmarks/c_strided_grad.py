"""The C backend's strided input gradients of dense convolutions: col2im of a product (the
``im2col`` kernel) against the direct loops that ran them before, kernels and a step.

    OMP_NUM_THREADS=1 python benchmarks/c_strided_grad.py --rounds 5 --steps 10 \\
        --out benchmarks/results/c_strided_grad-1thread.json

Kernels: the input gradient of each shape (ResNet's downsampling convolutions: 3x3 and
1x1 shortcuts at stride 2, the 7x7 stem, at batch 1 and 8), float32, timed with both
kernels in the tuning harness that ``CBackend(tune=True)`` uses (one set of operands, a
warm-up run, then the median of 3 to 9 runs of process CPU time), ``--rounds`` times; the
medians over the rounds and their ratio.

Step: ResNet-18's stages as plain 3x3 convolutions (``c_winograd.py``'s deep model: one
image of 56 x 56, 64 to 512 channels, a strided convolution into each stage, every weight
trained) compiled twice in this process, with the rule as it is and with the strided input
gradients on direct loops, then stepped in turn; the median process CPU seconds of
``--steps`` steps each, and whether the losses agree to 1e-4. ``--portable`` builds
without ``-march``. One JSON object on the last line; ``--out`` writes it to a file.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from typing import Any

from _harness import write_out
from c_winograd import _deep, _step_variants, kernel_bench_args, kernel_bench_result

# (name, batch, channels in, channels out, input side, filter side, stride, padding)
SHAPES = [
    ("resnet 3x3 64->128", 1, 64, 128, 56, 3, 2, 1),
    ("resnet 3x3 128->256", 1, 128, 256, 28, 3, 2, 1),
    ("resnet 3x3 256->512", 1, 256, 512, 14, 3, 2, 1),
    ("resnet 1x1 64->128", 1, 64, 128, 56, 1, 2, 0),
    ("resnet 1x1 256->512", 1, 256, 512, 14, 1, 2, 0),
    ("resnet 3x3 64->128", 8, 64, 128, 32, 3, 2, 1),
    ("resnet 3x3 128->256", 8, 128, 256, 16, 3, 2, 1),
    ("resnet stem 7x7 3->64", 1, 3, 64, 224, 7, 2, 3),
]
KERNELS = ["direct", "im2col"]


def _geometry(batch: int, cin: int, cout: int, side: int, k: int, s: int, p: int) -> Any:
    from pockengine.backends.c.conv_kernels import ConvGeometry

    out = (side + 2 * p - k) // s + 1
    return ConvGeometry(batch, cin, side, side, cout, k, k, out, out, s, s, p, p, 1, 1, 1)


def time_kernels(rounds: int, threads: int, portable: bool) -> list[dict[str, Any]]:
    """Each shape's input gradient with both kernels, medians over rounds."""
    from pockengine.backends.c import tune, tune_harness
    from pockengine.ir import DType

    rows = []
    for name, batch, cin, cout, side, k, s, p in SHAPES:
        g = _geometry(batch, cin, cout, side, k, s, p)
        samples: dict[str, list[float]] = {k: [] for k in KERNELS}
        for _ in range(rounds):
            seconds = tune_harness.harness_times(
                "conv2d_input_grad", KERNELS, DType.F32, g, tune._BUDGET_S, 1e9, portable, threads
            )
            for kernel, sec in zip(KERNELS, seconds, strict=True):
                samples[kernel].append(sec)
        ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
        rows.append({
            "shape": name, "batch": batch, "in": cin, "out": cout, "side": side, "filter": k,
            "stride": s, "ms": {k: round(v, 3) for k, v in ms.items()},
            "ratio": round(ms["im2col"] / ms["direct"], 3),
        })  # fmt: skip
    return rows


@contextlib.contextmanager
def _strided_direct() -> Iterator[None]:
    """The rule with strided dense input gradients on direct loops (what it took before)."""
    from pockengine.backends.c import conv_kernels

    saved = conv_kernels.rule_kernel

    def rule(op: str, g: Any, itemsize: int, *args: Any, **kwargs: Any) -> str:
        kernel = saved(op, g, itemsize, *args, **kwargs)
        strided = op == "conv2d_input_grad" and (g.sh, g.sw) != (1, 1)
        return "direct" if strided and kernel == "im2col" else kernel

    conv_kernels.rule_kernel = rule
    try:
        yield
    finally:
        conv_kernels.rule_kernel = saved


def time_steps(steps: int, threads: int, portable: bool) -> dict[str, Any]:
    """The deep model's step with the rule and with strided input gradients direct."""
    variants: dict[str, Callable[[], Any]] = {
        "rule": contextlib.nullcontext, "direct": _strided_direct}  # fmt: skip
    out = {
        "model": "ResNet-18's stages as 3x3 convolutions, 64-512 channels, 56 px, batch 1",
        **_step_variants(_deep(), variants, steps, threads, portable),
    }
    med = out["median_cpu_s"]
    out["ratio"] = round(med["rule"] / med["direct"], 3)
    return out


def main() -> None:
    args = kernel_bench_args(__doc__ or "")
    rows = time_kernels(args.rounds, args.threads, args.portable)
    print(f"{'shape':24} {'batch':>5} {'direct ms':>10} {'col2im ms':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['shape']:24} {r['batch']:>5} {r['ms']['direct']:>10.3f} "
              f"{r['ms']['im2col']:>10.3f} {r['ratio']:>6.3f}")  # fmt: skip
    step = time_steps(args.steps, args.threads, args.portable)
    print(f"step: {step['median_cpu_s']} -> {step['ratio']}x; losses agree: "
          f"{step['losses_agree']}; kernels {step['kernels']}")  # fmt: skip
    result = kernel_bench_result(args, rows, step)
    if args.out:
        write_out(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
