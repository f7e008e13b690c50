"""The C backend's step against PyTorch eager (and the torch backend), in CPU time a step.

    OMP_NUM_THREADS=1 python benchmarks/c_vs_eager.py --threads 1 --cases mbv2:sparse \
        --rounds 3 --out benchmarks/results/c_vs_eager-1thread.json

Cases as in torch_vs_eager.py (``mbv2``: MobileNetV2 width 1.0 at 128 px batch 8; ``mcu``:
width 0.35 batch 1; ``bert``, ``llama``; schemes sparse, full, head). Every run is its own
process: ``c`` (``pe.compile(..., backend=CBackend(threads=T))``, compiled in the
process), ``torch`` (``backend="torch"``, default options) and ``eager`` (autograd and
``torch.optim`` on the same weights, frozen set and batch). A round runs the three once,
the order rotating from round to round. Per run: the median over ``--steps`` steps (after
``--warmup``) of the process CPU time a step (user + system, all threads) and of the wall
time. CPU time is what this reports first: on a machine shared with other jobs the wall
time of a one-thread step stretches with the load (a 124 ms step measured 800 ms at load
average 12), its CPU time far less. Per case: the median ratios c/eager and c/torch of
each round. Writes ``--out`` (JSON) after each case and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _harness import ChildFailedError, run_child, utc_now

ENGINES = ("c", "torch", "eager")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run(case: str, engine: str, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    import step_bench
    import torch
    import torch_vs_eager

    import pockengine as pe
    from pockengine.backends.c import CBackend
    from pockengine.frontend.torch import torch_model_info

    workload, scheme_name = case.split(":")
    step_bench._load_framework("torch-eager" if engine == "eager" else "pockengine-torch")
    work, optimizer, schemes = torch_vs_eager._workload(workload)
    scheme = schemes[scheme_name]
    batch = work.make_batch(0)
    if engine == "eager":
        trained = set(scheme.resolve(torch_model_info(work.model)).names)
        step: Any = step_bench._torch_step("torch-eager", work, optimizer, trained)
    else:
        backend: Any = CBackend(threads=threads) if engine == "c" else "torch"
        step = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend,
                          compile_in="process")  # fmt: skip
    cpu: list[float] = []
    wall: list[float] = []
    for i in range(warmup + steps):
        cpu0, start = _cpu(), time.perf_counter()
        with torch.no_grad() if engine != "eager" else contextlib.nullcontext():
            step(*batch)
        if i >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(_cpu() - cpu0)
    return {"case": case, "engine": engine, "cpu_ms": statistics.median(cpu) * 1e3,
            "wall_ms": statistics.median(wall) * 1e3, "threads": threads}  # fmt: skip


def _case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for k in range(args.rounds):
        order = ENGINES[k % 3 :] + ENGINES[: k % 3]
        for engine in order:
            argv = [__file__, "--child", case, engine, "--steps", args.steps,
                    "--warmup", args.warmup, "--threads", args.threads]  # fmt: skip
            try:
                runs[engine].append(run_child(argv, args.threads))
            except ChildFailedError as e:
                return {"case": case, "error": f"{engine}: {e.last_line}"}

    def ratio(other: str, key: str) -> float:
        pairs = zip(runs["c"], runs[other], strict=True)
        return statistics.median(c[key] / o[key] for c, o in pairs)

    return {"case": case, "c_eager_cpu": ratio("eager", "cpu_ms"),
            "c_torch_cpu": ratio("torch", "cpu_ms"), "c_eager_wall": ratio("eager", "wall_ms"),
            "c_torch_wall": ratio("torch", "wall_ms"), "runs": runs}  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | CPU ms a step: C / torch backend / eager | C / eager | C / torch "
             "| wall ms: C / torch / eager | C / eager (wall) |",
             "|---|---|---:|---:|---|---:|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} | | | | |")
            continue

        def med(engine: str, key: str, r: dict[str, Any] = r) -> float:
            return statistics.median(x[key] for x in r["runs"][engine])

        cpu = " / ".join(f"{med(e, 'cpu_ms'):.0f}" for e in ENGINES)
        wall = " / ".join(f"{med(e, 'wall_ms'):.0f}" for e in ENGINES)
        lines.append(f"| {r['case']} | {cpu} | **{r['c_eager_cpu']:.2f}** | "
                     f"{r['c_torch_cpu']:.2f} | {wall} | {r['c_eager_wall']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="*", default=["mbv2:sparse", "mbv2:full", "mbv2:head"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        out = _run(*args.child, args.steps, args.warmup, args.threads)
        print(json.dumps(out))
        return 0
    rows = []
    for case in args.cases:
        rows.append(_case(case, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), flush=True)
        if args.out:
            command = "python " + " ".join(sys.argv)
            body = {"date": utc_now(), "threads": args.threads, "command": command,
                    "rows": rows}  # fmt: skip
            Path(args.out).write_text(json.dumps(body, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
