"""Device footprint: the memory and step time a device sees, per way of running one step.

    python benchmarks/device_footprint.py                 # MCU-class workload, 2 threads
    python benchmarks/device_footprint.py --steps 50 --threads 1

Workload: MobileNetV2 width 0.35, 3x128x128, batch 1, 10 classes, the sparse scheme (the
recipe's last 4 blocks, biases and head), SGD with momentum. Every case runs in its own
process and reports its whole-process peak RSS (``/usr/bin/time -v`` of the executable,
or VmHWM read by the Python process itself), its RSS before the model exists ("idle": the
interpreter and the framework loaded, or for the stand-alone trainer the same binary
started without work), and the median step time:

- ``c-trainer``: ``step.export(folder, target="c")``, ``make NATIVE=1 STATIC=1 SMALL=1`` (one
  thread) or ``make NATIVE=1 OPENMP=1``, then ``./train``;
- ``ort-runner``: ``step.export()`` run by ``pockengine/ort_runner.py`` (numpy + onnxruntime);
- ``pockengine-c`` / ``pockengine-torch``: ``pe.compile`` in the same process;
- ``torch-eager``: autograd and ``torch.optim.SGD`` on the same weights, frozen set, batch.

Writes benchmarks/results/device_footprint.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, run_child, vm_mib

CASES = ("c-trainer", "ort-runner", "pockengine-c", "pockengine-torch", "torch-eager")


def _workload() -> tuple[Any, Any, Any]:
    import pockengine as pe
    from pockengine import zoo

    work = zoo.mobilenet_v2(width=0.35, batch=1, size=128, classes=10)
    return work, pe.optim.SGD(lr=0.01, momentum=0.9), pe.schemes.sparse(blocks=4)


def _planned_mib(graph: Any) -> float:
    from pockengine.plan import plan_memory

    return float(plan_memory(graph).planned_peak_bytes / 2**20)


def _in_process(case: str, steps: int, threads: int) -> dict[str, Any]:
    """One Python case (run in a fresh interpreter by ``main``)."""
    import torch

    import pockengine as pe

    torch.set_num_threads(threads)
    idle = vm_mib("VmRSS")
    work, optimizer, scheme = _workload()
    batch = work.make_batch(0)
    planned = None
    if case == "torch-eager":
        from pockengine.frontend.torch import torch_model_info

        trained = set(scheme.resolve(torch_model_info(work.model)).names)
        for name, p in work.model.named_parameters():
            p.requires_grad_(name in trained)
        opt = torch.optim.SGD([p for p in work.model.parameters() if p.requires_grad],
                              lr=0.01, momentum=0.9)  # fmt: skip

        def step(*b: Any) -> float:
            opt.zero_grad(set_to_none=True)
            loss = work.loss_fn(work.model, *b)
            loss.backward()
            opt.step()
            return float(loss.detach())

    else:
        compiled = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                              backend=case.split("-", 1)[1])  # fmt: skip
        planned = _planned_mib(compiled.graph)
        step = compiled
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - t)
    return {"idle_mib": idle, "step_ms": statistics.median(times[1:]) * 1e3,
            "planned_mib": planned, "peak_mib": vm_mib("VmHWM")}  # fmt: skip


def _peak_of(
    cmd: list[str], env: dict[str, str], cwd: Path | None = None, check: bool = True
) -> tuple[str, str, float]:
    """stdout, stderr and the whole-process peak RSS (MiB) of ``cmd``, via /usr/bin/time -v
    when it is there, else ``ru_maxrss`` of the children."""
    import resource

    if Path("/usr/bin/time").exists():
        done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                              env=env, cwd=cwd, check=check)  # fmt: skip
        line = next(ln for ln in done.stderr.splitlines() if "Maximum resident" in ln)
        return done.stdout, done.stderr, int(line.split()[-1]) / 1024
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, check=check)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return done.stdout, done.stderr, max(before, after) / 1024


def _export(folder: Path, target: str) -> float:
    """Export the workload's step (compiled on the NumPy backend); its planned peak, MiB."""
    import numpy as np

    import pockengine as pe

    work, optimizer, scheme = _workload()
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme)
    if target == "c":
        step.export(folder, target="c")
        np.save(folder / "X.npy", batch[0].numpy())
        np.save(folder / "Y.npy", batch[1].numpy())
    else:
        step.export(folder / "train_step.onnx")
        np.savez(
            folder / "batches.npz", **{"0": batch[0].numpy()[None], "1": batch[1].numpy()[None]}
        )
    return _planned_mib(step.graph)


def c_trainer(steps: int, threads: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="pe_footprint_c_"))
    planned = _export(folder, "c")
    # One thread: the smallest build (static, unused code dropped, -O2); threads: OpenMP.
    flags = ["NATIVE=1", *(["OPENMP=1"] if threads > 1 else ["STATIC=1", "SMALL=1"])]
    subprocess.run(["make", "-s", "-C", str(folder), *flags], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    idle = _peak_of(["./train", "--help"], env, folder, check=False)[2]  # usage, exit 2
    cmd = ["./train", "--steps", str(steps + 1), "--threads", str(threads), "X.npy", "Y.npy"]
    _, err, peak = _peak_of(cmd, env, folder)
    ms = float(next(ln for ln in err.splitlines() if ln.startswith("mean step")).split()[3])
    return {"peak_mib": peak, "idle_mib": idle, "step_ms": ms, "planned_mib": planned,
            "build": " ".join(flags)}  # fmt: skip


def ort_runner(steps: int, threads: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="pe_footprint_ort_"))
    planned = _export(folder, "onnx")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    runner = str(ROOT / "pockengine" / "ort_runner.py")
    idle = _peak_of([sys.executable, "-c", "import numpy, onnxruntime"], env, folder)[2]
    cmd = [sys.executable, runner, "train_step.onnx", "--batches", "batches.npz",
           "--steps", str(steps + 1)]  # fmt: skip
    t = time.perf_counter()
    _, _, peak = _peak_of(cmd, env, folder)
    wall = (time.perf_counter() - t) / (steps + 1) * 1e3
    return {"peak_mib": peak, "idle_mib": idle, "step_ms": wall, "planned_mib": planned,
            "build": "wall time / steps, session start included"}  # fmt: skip


def python_case(case: str, steps: int, threads: int) -> dict[str, Any]:
    """A Python case in a fresh process, which reports its own peak (VmHWM): the C
    compiler that ``pe.compile(backend="c")`` may run is a process of its own."""
    return run_child([__file__, "--child", case, "--steps", steps, "--threads", threads],
                     threads, extra_env={"PYTHONPATH": str(ROOT)})  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | whole-process peak RSS | idle | above idle | planned peak | step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        planned = f"{r['planned_mib']:.2f} MiB" if r.get("planned_mib") else ""
        lines.append(
            f"| {r['case']} | {r['peak_mib']:.1f} MiB | {r['idle_mib']:.1f} MiB | "
            f"{r['peak_mib'] - r['idle_mib']:.1f} MiB | {planned} | {r['step_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/device_footprint.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_in_process(args.child, args.steps, args.threads)))
        return 0
    rows = []
    for case in args.cases:
        if case == "c-trainer":
            row = c_trainer(args.steps, args.threads)
        elif case == "ort-runner":
            row = ort_runner(args.steps, args.threads)
        else:
            row = python_case(case, args.steps, args.threads)
        rows.append({"case": case, **row})
        print(json.dumps(rows[-1]), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
