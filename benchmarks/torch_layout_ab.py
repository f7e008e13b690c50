"""The torch backend's memory options side by side, each case in its own process.

    python benchmarks/torch_layout_ab.py --workload mbv2 --scheme head --repeat 3

Variants: ``default`` (frozen weights shared in the layout they arrive in),
``frozen-cl`` (``TorchBackend(frozen_channels_last=True)``: frozen 4-D weights copied
channels-last, the layout before session 7) and ``trim`` (``TorchBackend(trim_heap=True)``).
Per process: the whole-process peak RSS over compiling and 12 steps minus the RSS once the
framework, the weights and the batch are loaded (as ``step_bench.py`` measures training
memory), and the fastest and median step time of the last 10 steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import step_bench
from _harness import ChildFailedError, run_child, vm_kib

VARIANTS: dict[str, dict[str, bool]] = {
    "default": {},
    "frozen-cl": {"frozen_channels_last": True},
    "trim": {"trim_heap": True},
}


def run_variant(workload: str, scheme_name: str, variant: str, threads: int) -> dict[str, Any]:
    import torch

    import pockengine as pe
    from pockengine.backends.torch.backend import TorchBackend

    torch.set_num_threads(threads)
    step_bench._load_framework("pockengine-torch")
    work, optimizer, scheme, _ = step_bench._case(workload, scheme_name)
    batch = work.make_batch(0)
    base = vm_kib("VmRSS")
    backend = TorchBackend(**VARIANTS[variant])
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend)
    model, work.model = work.model, None
    del model
    gc.collect()
    times = []
    with torch.no_grad():
        for _ in range(12):
            start = time.perf_counter()
            step(*batch)
            times.append(time.perf_counter() - start)
    peak = vm_kib("VmHWM")
    return {"workload": workload, "scheme": scheme_name, "variant": variant,
            "train_mem_mib": (peak - base) / 1024, "min_ms": min(times[2:]) * 1e3,
            "median_ms": statistics.median(times[2:]) * 1e3}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="head")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        result = run_variant(args.workload, args.scheme, args.variant, args.threads)
        print(json.dumps(result))
        return 0
    for _ in range(args.repeat):  # interleaved, so load drifts hit every variant alike
        for variant in args.variants:
            argv = [__file__, "--workload", args.workload, "--scheme", args.scheme,
                    "--threads", args.threads, "--variant", variant]  # fmt: skip
            try:
                print(json.dumps(run_child(argv, args.threads)), flush=True)
            except ChildFailedError as e:
                print(json.dumps({"variant": variant, "error": e.last_line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
