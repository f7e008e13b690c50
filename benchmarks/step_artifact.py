"""step_bench's artifact frameworks: the step compiled in one process, trained in another.

``pockengine-c-artifact`` and ``pockengine-torch-artifact`` measure what a device that
trains without the compiler sees: a first child compiles the case and writes the step
artifact (``step.save``) and the batch (``.npy``); the measured process only loads them
(``pockengine.load_step``), so it never imports a frontend, ``torch.export`` or the IR
passes (the C variant does not import torch at all) and holds nothing compiling left.

Training memory is comparable with step_bench's other frameworks, whose idle process
holds the model's weights: the whole-process peak RSS minus the idle process (the
framework loaded by a tiny artifact's step, the batch in memory) minus the step's params
and buffers (``weights_mib``), which this process reads from the artifact instead.

    python benchmarks/step_artifact.py --prepare mbv2 sparse c DIR   # what step_bench runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ChildFailedError, reset_peak, run_child, vm_kib

__all__ = ["SUFFIX", "backend_of", "graph_flops", "prepare", "run_case"]

SUFFIX = "-artifact"
_TINY, _STEP = "tiny", "step"


def backend_of(framework: str) -> str:
    """``pockengine-c-artifact`` -> ``c``."""
    return framework.removeprefix("pockengine-").removesuffix(SUFFIX)


def prepare(workload: str, scheme_name: str, backend: str, folder: Path) -> None:
    """Compile the tiny MLP and the case on ``backend`` and save both steps and the case's
    batch (``.npy`` files) under ``folder``: what a host ships to the device."""
    import pockengine as pe
    from pockengine import zoo

    tiny = zoo.mlp()
    tiny_batch = tiny.make_batch(0)
    pe.compile(tiny.model, tiny.loss_fn, tiny_batch, backend=backend).save(folder / _TINY)
    _save_batch(folder, _TINY, tiny_batch)
    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend)
    step.save(folder / _STEP)
    _save_batch(folder, _STEP, batch)


def _save_batch(folder: Path, name: str, batch: Any) -> None:
    import numpy as np

    for k, item in enumerate(batch):
        np.save(folder / f"{name}.batch.{k}.npy", item.detach().numpy())


def _read_batch(folder: Path, name: str) -> list[Any]:
    import numpy as np

    count = len(list(folder.glob(f"{name}.batch.*.npy")))
    return [np.load(folder / f"{name}.batch.{k}.npy") for k in range(count)]


def graph_flops(graph: Any) -> int:
    """The matmul and convolution FLOPs of ``graph`` (PockEngine's cost model): the count
    step_bench divides by the step time for every framework."""
    from pockengine.plan.cost import cost

    ops = {"matmul", "linear", "conv2d", "conv2d_input_grad", "conv2d_weight_grad"}
    return sum(c.flops for n, c in zip(graph.nodes, cost(graph).nodes, strict=True)
               if n.op in ops)  # fmt: skip


def _weights_bytes(step: Any) -> int:
    from pockengine.ir import Role

    return sum(v.type.nbytes for v in step.graph.inputs if v.role in (Role.PARAM, Role.BUFFER))


def _load_framework(folder: Path, backend: str, threads: int) -> None:
    """The backend's code in the idle process: the tiny artifact loaded and run once."""
    import pockengine as pe

    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    tiny = pe.load_step(folder / _TINY, backend=backend)
    tiny(*_read_batch(folder, _TINY))
    del tiny
    gc.collect()


def _measure(folder: Path, backend: str, steps: int, warmup: int) -> dict[str, Any]:
    import pockengine as pe
    from pockengine.plan.memory import plan_memory

    batch = _read_batch(folder, _STEP)
    base = vm_kib("VmRSS")
    start = time.perf_counter()
    step = pe.load_step(folder / _STEP, backend=backend)
    load_s = time.perf_counter() - start
    times, loss, whole = [], 0.0, 0
    for i in range(warmup + steps):
        if i == warmup:
            whole = vm_kib("VmHWM")
            reset_peak()
        t = time.perf_counter()
        loss = step(*batch)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    steady = vm_kib("VmHWM")
    weights = _weights_bytes(step) / 2**20
    plan = plan_memory(step.graph)
    planned = (plan.arena_bytes + plan.state_bytes + plan.const_bytes) / 2**20
    peak = max(whole, steady)
    median = statistics.median(times)
    flops = graph_flops(step.graph)
    return {
        "step_ms": median * 1e3, "compile_s": load_s, "loss": loss,
        "train_mem_mib": (peak - base) / 1024 - weights, "peak_rss_mib": peak / 1024,
        "step_mem_mib": (steady - base) / 1024 - weights, "base_rss_mib": base / 1024,
        "weights_mib": weights, "planned_train_mib": planned,
        "gflop": flops / 1e9, "gflops": flops / median / 1e9,
        "torch_imported": "torch" in sys.modules,
    }  # fmt: skip


def run_case(
    workload: str, scheme_name: str, framework: str, steps: int, warmup: int, threads: int
) -> dict[str, Any]:
    """One artifact case: prepared by a child process, loaded and trained in this one;
    ``compile_s`` is the time ``load_step`` takes."""
    backend = backend_of(framework)
    with tempfile.TemporaryDirectory(prefix="pe-artifact-") as tmp:
        folder = Path(tmp)
        try:
            run_child([__file__, "--prepare", workload, scheme_name, backend, folder], threads)
        except ChildFailedError as e:
            raise RuntimeError(f"preparing the artifact failed: {e.last_line}") from None
        _load_framework(folder, backend, threads)
        result = _measure(folder, backend, steps, warmup)
    return {"workload": workload, "scheme": scheme_name, "framework": framework, **result}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prepare", nargs=4, required=True,
                        metavar=("WORKLOAD", "SCHEME", "BACKEND", "DIR"))  # fmt: skip
    args = parser.parse_args()
    workload, scheme_name, backend, folder = args.prepare
    prepare(workload, scheme_name, backend, Path(folder))
    print(json.dumps({"prepared": folder}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
