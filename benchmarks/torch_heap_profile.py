"""Where a torch-backend step's CPU time and page faults go, in this process.

    PYTHONPATH=$PWD python benchmarks/torch_heap_profile.py mbv2 sparse
    PYTHONPATH=$PWD python benchmarks/torch_heap_profile.py mbv2 sparse \\
        --options '{"step_heap": false, "trim_peak": true}' --trace
    PYTHONPATH=$PWD python benchmarks/torch_heap_profile.py mbv2 sparse --eager

Compiles the workload's step in this process with ``TorchBackend(**OPTIONS)`` (or runs
PyTorch eager on the same weights, frozen set and batch), runs ``--warmup`` steps and then
``--steps`` more, and prints the medians of each step's user and system CPU time and minor
page faults (``getrusage``: a loaded machine stretches them far less than wall time).
``--trace`` then runs one more step with a line tracer on the generated function and
prints the page faults of each op (summed over its lines); ``--profile N`` runs one more
step under ``torch.profiler`` and prints its ``N`` ATen ops of most self CPU time, with
their calls (both frameworks: compare ours against ``--eager`` at the same thread count).
Workloads: ``zoo.benchmark``'s, and ``mcu`` (MobileNetV2 width 0.35, 128 px, batch 1).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import statistics
import sys
from types import FrameType
from typing import Any

import torch_vs_eager


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _eager(work: Any, optimizer: Any, scheme: Any) -> Any:
    import step_bench

    from pockengine.frontend.torch import torch_model_info

    trained = set(scheme.resolve(torch_model_info(work.model)).names)
    return step_bench._torch_step("torch-eager", work, optimizer, trained)


def _trace(step: Any, batch: Any) -> collections.Counter[str]:
    """Page faults of each op of one run of ``step``'s generated function."""
    function = step._exec.function
    lines = step._exec.source.splitlines()
    per_line: collections.Counter[int] = collections.Counter()
    at: dict[str, Any] = {"line": None, "faults": 0}

    def local(frame: FrameType, event: str, arg: object) -> Any:
        now = _usage()[2]
        if at["line"] is not None:
            per_line[at["line"]] += now - at["faults"]
        at["line"] = frame.f_lineno if event == "line" else None
        at["faults"] = _usage()[2]
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is function.__code__ else None

    sys.settrace(tracer)
    try:
        step(*batch)
    finally:
        sys.settrace(None)
    per_op: collections.Counter[str] = collections.Counter()
    for line, faults in per_line.items():
        match = re.search(r"# %\S+.*?= (\w+)\(", lines[line - 1])
        per_op[match.group(1) if match else "(other)"] += faults
    return per_op


def _profile(step: Any, batch: Any, rows: int) -> str:
    """One more step under ``torch.profiler``: its ``rows`` ops of most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*batch)
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages) / 1e3
    calls = sum(e.count for e in averages)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"{calls} op calls, {total:.0f} ms of self CPU time\n{table}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload", choices=torch_vs_eager.WORKLOADS)
    parser.add_argument("scheme", choices=torch_vs_eager.SCHEMES)
    parser.add_argument("--options", default="{}", help="TorchBackend keyword arguments (JSON)")
    parser.add_argument("--eager", action="store_true", help="PyTorch eager instead")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N ops of most self CPU time of one more step")  # fmt: skip
    args = parser.parse_args()
    import torch

    import pockengine as pe
    from pockengine.backends.torch.backend import TorchBackend

    torch.set_num_threads(args.threads)
    work, optimizer, schemes = torch_vs_eager._workload(args.workload)
    scheme, batch = schemes[args.scheme], work.make_batch(0)
    if args.eager:
        step = _eager(work, optimizer, scheme)
    else:
        backend = TorchBackend(**json.loads(args.options))
        step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend,
                          compile_in="process")  # fmt: skip
    user, system, faults = [], [], []
    for i in range(args.warmup + args.steps):
        before = _usage()
        step(*batch)
        after = _usage()
        if i >= args.warmup:
            user.append(after[0] - before[0])
            system.append(after[1] - before[1])
            faults.append(after[2] - before[2])
    label = "eager" if args.eager else f"TorchBackend(**{args.options})"
    print(f"{args.workload} {args.scheme}, {label}, {args.threads} thread(s): user "
          f"{statistics.median(user) * 1e3:.0f} ms, system {statistics.median(system) * 1e3:.0f}"
          f" ms, {statistics.median(faults):.0f} minor faults a step")  # fmt: skip
    if args.trace and not args.eager:
        for op, n in _trace(step, batch).most_common(8):
            print(f"{n:8d} faults ({n * 4 / 1024:6.1f} MiB)  {op}")
    if args.profile:
        print(_profile(step, batch, args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
