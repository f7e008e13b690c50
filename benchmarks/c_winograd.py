"""The C backend's dense 3x3 stride-1 convolution kernels on VGG- and ResNet-style shapes,
and a whole training step with and without Winograd F(4x4, 3x3).

    OMP_NUM_THREADS=1 python benchmarks/c_winograd.py --rounds 5 --steps 10 \
        --out benchmarks/results/c_winograd-1thread.json
    OMP_NUM_THREADS=1 python benchmarks/c_winograd.py --portable ...

``--portable`` builds the kernels as an exported trainer's plain ``make`` does (``-O3``,
no ``-march``: SSE2 on x86-64) instead of for this machine.

Kernels: each shape's forward, input gradient and weight gradient, float32, is timed with
every candidate (the implicit GEMM ``im2col``, Winograd F(2x2, 3x3) ``winograd``, which has
no weight gradient, and F(4x4, 3x3) ``winograd4``) in the tuning harness that
``CBackend(tune=True)`` uses (one set of operands, a warm-up run, then the median of 3 to 9
runs of process CPU time), ``--rounds`` times;
the table shows the medians over the rounds, each kernel's time against the implicit
GEMM's, and the rule's choice for the build (``conv_kernels.rule_kernel``).

Step: a VGG-style CNN (3x3 convolutions of 32, 64 and 128 channels on 32 x 32 images,
batch 8, every weight trained, SGD) compiled twice in this process, with the rule as it
is and with the rule's F(4x4, 3x3) branch off (what it took before: F(2x2, 3x3) from 32
channels, else the implicit GEMM) and, in a build with the wide FMA GEMM (AVX2 or
AVX-512), with the portable build's rule (F(2x2, 3x3) from 32 channels, where the rule
takes the implicit GEMM above 64), then stepped in turn on one batch; the median process
CPU seconds of ``--steps`` steps each, and whether the losses agree to 1e-4. With the wide
FMA GEMM, also ResNet-18's stages as plain 3x3 convolutions (64 to 512 channels, one image
of 56 x 56) with the rule and with the portable build's rule. One JSON object on the last
line; ``--out`` writes it to a file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _harness import out_file, write_out

from pockengine.finetune.arg_types import positive_int

# (name, batch, channels in, channels out, map side)
SHAPES = [
    ("cifar-resnet 16ch", 8, 16, 16, 32),
    ("cifar-resnet 32ch", 8, 32, 32, 16),
    ("cifar-resnet 64ch", 8, 64, 64, 8),
    ("vgg 64ch 64px", 8, 64, 64, 64),
    ("vgg 128ch 32px", 8, 128, 128, 32),
    ("resnet18 64ch 56px", 1, 64, 64, 56),
    ("resnet18 128ch 28px", 1, 128, 128, 28),
    ("resnet18 256ch 14px", 1, 256, 256, 14),
    ("resnet18 512ch 7px", 1, 512, 512, 7),
    ("stem-like 3->32", 8, 3, 32, 32),
]
KERNELS = ["im2col", "winograd", "winograd4"]


def _geometry(batch: int, cin: int, cout: int, side: int) -> Any:
    from pockengine.backends.c.conv_kernels import ConvGeometry

    return ConvGeometry(batch, cin, side, side, cout, 3, 3, side, side, 1, 1, 1, 1, 1, 1, 1)


def time_kernels(rounds: int, threads: int, portable: bool) -> list[dict[str, Any]]:
    """Every shape's three ops with each kernel, medians over rounds."""
    from pockengine.backends.c import tune, tune_harness
    from pockengine.backends.c.conv_kernels import CONV_OPS, implemented, rule_kernel
    from pockengine.backends.c.driver import has_fast_gemm
    from pockengine.ir import DType

    rows, fast = [], has_fast_gemm(portable)
    for name, batch, cin, cout, side in SHAPES:
        g = _geometry(batch, cin, cout, side)
        for op in CONV_OPS:
            kernels = [k for k in KERNELS if implemented(op, k)]
            samples: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(rounds):
                seconds = tune_harness.harness_times(op, kernels, DType.F32, g, tune._BUDGET_S,
                                                     1e9, portable, threads)  # fmt: skip
                for k, s in zip(kernels, seconds, strict=True):
                    samples[k].append(s)
            ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
            rows.append({
                "shape": name, "op": op, "batch": batch, "in": cin, "out": cout, "side": side,
                "ms": {k: round(v, 3) for k, v in ms.items()},
                "vs_im2col": {k: round(v / ms["im2col"], 3) for k, v in ms.items()},
                "rule": rule_kernel(op, g, 4, fast_gemm=fast),
            })  # fmt: skip
    return rows


@contextlib.contextmanager
def _portable_rule() -> Iterator[None]:
    """The rule of a build without the wide FMA GEMM (F(2x2, 3x3) from 32 channels up)."""
    from pockengine.backends.c import backend

    saved = backend.has_fast_gemm
    backend.has_fast_gemm = lambda portable=None: False
    try:
        yield
    finally:
        backend.has_fast_gemm = saved


@contextlib.contextmanager
def _without_winograd4() -> Iterator[None]:
    """The rule with its F(4x4, 3x3) branch off."""
    from pockengine.backends.c import conv_kernels

    saved = conv_kernels._winograd4_wins
    conv_kernels._winograd4_wins = lambda op, g: False
    try:
        yield
    finally:
        conv_kernels._winograd4_wins = saved


def _vgg() -> tuple[Any, Any, tuple[Any, ...]]:
    import torch
    from torch import nn

    torch.manual_seed(0)

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU()]  # fmt: skip

    model = nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    return model, loss_fn, batch


def _deep() -> tuple[Any, Any, tuple[Any, ...]]:
    """ResNet-18's stages as plain 3x3 convolutions, one image of 56 x 56: 64 channels, then
    128 on 28 x 28, 256 on 14 x 14 and 512 on 7 x 7 (each stage a strided convolution in
    and one at stride 1)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1), nn.ReLU()]
    for cin, cout in ((64, 128), (128, 256), (256, 512)):
        layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.ReLU(),
                   nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU()]  # fmt: skip
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(1, 3, 56, 56, generator=g), torch.randint(0, 10, (1,), generator=g))
    return model, loss_fn, batch


def _step_variants(
    made: tuple[Any, Any, tuple[Any, ...]],
    variants: dict[str, Callable[[], Any]],
    steps: int,
    threads: int,
    portable: bool,
) -> dict[str, Any]:
    """Each variant of the rule compiled in turn, then stepped in turn on one batch: the
    kernels each calls, the median CPU seconds, whether the losses agree to 1e-4."""
    import pockengine as pe
    from pockengine.backends.c import CBackend

    model, loss_fn, batch = made
    compiled, kernels = {}, {}
    for name, variant in variants.items():
        with variant():  # the source is emitted again on each read: read it under the same rule
            compiled[name] = pe.compile(model, loss_fn, batch, pe.optim.SGD(lr=0.01),
                                        backend=CBackend(portable, threads))  # fmt: skip
            calls = re.findall(r"pe_(conv2d\w*)_f32\(", compiled[name]._exec.source)
        kernels[name] = dict(sorted(collections.Counter(calls).items()))
    seconds: dict[str, list[float]] = {name: [] for name in compiled}
    losses: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(steps + 1):  # the first step of each warms up
        for name, step in compiled.items():
            start = time.process_time()
            losses[name].append(float(step(*batch)))
            seconds[name].append(time.process_time() - start)
    med = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    first = next(iter(losses.values()))
    agree = all(abs(a - b) <= 1e-4 * max(1.0, abs(b))
                for ls in losses.values() for a, b in zip(ls, first, strict=True))  # fmt: skip
    return {"kernels": kernels, "median_cpu_s": {k: round(v, 4) for k, v in med.items()},
            "losses_agree": agree}  # fmt: skip


def time_steps(steps: int, threads: int, portable: bool) -> dict[str, Any]:
    """The VGG-style step with the rule, with its F(4x4, 3x3) branch off and, built for
    this machine with the wide FMA GEMM, with the portable build's rule, in turn."""
    from pockengine.backends.c.driver import has_fast_gemm

    variants: dict[str, Callable[[], Any]] = {
        "winograd4": contextlib.nullcontext, "without": _without_winograd4}  # fmt: skip
    if has_fast_gemm(portable):
        variants["portable_rule"] = _portable_rule
    out = {
        "model": "VGG-style: 3x3 convolutions 3-32-32, 32-64-64, 64-128-128 on 32x32, batch 8",
        **_step_variants(_vgg(), variants, steps, threads, portable),
    }
    med = out["median_cpu_s"]
    out["ratio"] = round(med["winograd4"] / med["without"], 3)
    if "portable_rule" in med:  # the rule as it is against the portable build's rule
        out["ratio_portable_rule"] = round(med["winograd4"] / med["portable_rule"], 3)
    return out


def time_deep_steps(steps: int, threads: int, portable: bool) -> dict[str, Any] | None:
    """Built with the wide FMA GEMM: the ResNet-style step with the rule and with the
    portable build's rule (else None: the two rules are one)."""
    from pockengine.backends.c.driver import has_fast_gemm

    if not has_fast_gemm(portable):
        return None
    variants: dict[str, Callable[[], Any]] = {
        "rule": contextlib.nullcontext, "portable_rule": _portable_rule}  # fmt: skip
    out = {
        "model": "ResNet-18's stages as 3x3 convolutions, 64-512 channels, 56 px, batch 1",
        **_step_variants(_deep(), variants, steps, threads, portable),
    }
    med = out["median_cpu_s"]
    out["ratio_portable_rule"] = round(med["rule"] / med["portable_rule"], 3)
    return out


def kernel_bench_args(doc: str) -> argparse.Namespace:
    """The options of a kernels-then-step benchmark (this one, ``c_strided_grad.py``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=5, help="kernel timing rounds")
    parser.add_argument("--steps", type=positive_int, default=10, help="steps a variant")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--portable", action="store_true", help="-O3 without -march")
    parser.add_argument("--out", type=out_file, help="also write the JSON here")
    return parser.parse_args()


def kernel_bench_result(
    args: argparse.Namespace, rows: list[dict[str, Any]], step: dict[str, Any]
) -> dict[str, Any]:
    """Its JSON: the options, the kernels' rows and the step."""
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"args": options, "threads": args.threads, "portable": args.portable,
            "rounds": args.rounds, "kernels": rows, "step": step}  # fmt: skip


def main() -> None:
    args = kernel_bench_args(__doc__ or "")
    rows = time_kernels(args.rounds, args.threads, args.portable)
    print(f"{'shape':22} {'op':18} " + " ".join(f"{k:>16}" for k in KERNELS) + "  rule")
    for r in rows:
        cells = " ".join(f"{r['ms'][k]:8.2f} ({r['vs_im2col'][k]:.2f}x)" if k in r["ms"]
                         else f"{'-':>16}" for k in KERNELS)  # fmt: skip
        print(f"{r['shape']:22} {r['op']:18} {cells}  {r['rule']}")
    step = time_steps(args.steps, args.threads, args.portable)
    print(f"step: {step['median_cpu_s']} -> {step['ratio']}x; losses agree: "
          f"{step['losses_agree']}; kernels {step['kernels']}")  # fmt: skip
    deep = time_deep_steps(args.steps, args.threads, args.portable)
    if deep is not None:
        print(f"deep step: {deep['median_cpu_s']} -> {deep['ratio_portable_rule']}x; losses "
              f"agree: {deep['losses_agree']}; kernels {deep['kernels']}")  # fmt: skip
    result = kernel_bench_result(args, rows, step)
    if deep is not None:
        result["deep_step"] = deep
    text = json.dumps(result)
    if args.out:
        write_out(args.out, result)
    print(text)


if __name__ == "__main__":
    main()
