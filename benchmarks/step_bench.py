"""Training-step benchmark: workload x scheme x framework, each case in its own process.

    python benchmarks/step_bench.py                       # everything, CPU, 2 threads
    python benchmarks/step_bench.py --workloads mbv2 --schemes sparse \
        --frameworks pockengine-torch torch-eager --steps 10

Writes benchmarks/results/step_bench.json (``--json``) and prints a Markdown table
(``--out FILE`` also writes it there). ``--repeat N`` runs every case in N separate
processes and reports the median of each figure (all runs stay in the JSON). Per case:
median step time over ``--steps`` steps after ``--warmup`` steps (and the medians of a
measured step's CPU time, user + system over all threads, and minor page faults,
``getrusage``), compile time (first
call for torch.compile; ``load_step`` for the artifact frameworks, step_artifact.py),
training memory (peak RSS minus the RSS once the framework is imported and the weights
and batch are loaded), the final loss, and achieved GFLOP/s from the analytic FLOPs of
the step's matmuls and convolutions (the same count for every framework, from
PockEngine's cost model of that scheme). A large matmul measured in the same run gives
the attainable GFLOP/s. ``--in-place``: PockEngine trains the module's own tensors, as
eager does (``pe.compile(..., in_place=True)``; the rows say "in place"); without it the
step copies the params it trains and the module is dropped after compiling.
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

import ort_training_peer
import step_artifact
from _harness import ROOT, ChildFailedError, run_child
from _harness import reset_peak as _reset_peak
from _harness import vm_kib as _rss_kib

FRAMEWORKS = (
    "pockengine-torch",
    "pockengine-onnxruntime",
    "pockengine-c",
    "torch-eager",
    "torch-compile",
    # compiled and saved in one process, loaded (pockengine.load_step) and trained in
    # another that never compiles: what a device sees (step_artifact.py)
    "pockengine-torch" + step_artifact.SUFFIX,
    "pockengine-c" + step_artifact.SUFFIX,
) + (
    ("ort-training",) if ort_training_peer.venv_possible() else ()
)  # ONNX Runtime's on-device training, in its own venv (see ort_training_peer.py)
WORKLOADS = ("mbv2", "mcu", "bert", "llama")
SCHEMES = ("full", "bias-only", "sparse", "head")  # names: pockengine.sparse.schemes


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _matmul_gflops(n: int = 2048, reps: int = 10) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times) / 1e9


def _case(workload: str, scheme_name: str) -> tuple[Any, Any, Any, set[str]]:
    """A case's fresh workload, its optimizer, the scheme and the names it trains."""
    from pockengine import zoo
    from pockengine.frontend.torch import torch_model_info

    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    return work, optimizer, scheme, set(scheme.resolve(torch_model_info(work.model)).names)


def _analytic_flops(workload: str, scheme_name: str) -> int:
    """Matmul and convolution FLOPs of one step under the scheme (forward + backward), on a
    fresh copy of the workload (counted after measuring, outside the measured process state)."""
    import pockengine as pe

    work, optimizer, scheme, _ = _case(workload, scheme_name)
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), optimizer, scheme)
    return step_artifact.graph_flops(step.graph)


def _load_framework(framework: str, compile_in: str = "process") -> None:
    """Load all of the framework (a compiler loads torch.export or dynamo and inductor on
    first use, autograd starts its engine on the first backward) by compiling and running a
    tiny MLP step, so its code is in the base RSS."""
    import gc

    import pockengine as pe
    from pockengine import zoo

    tiny = zoo.mlp()
    batch = tiny.make_batch(0)
    if framework.startswith("pockengine"):
        backend = framework.split("-", 1)[1]
        pe.compile(tiny.model, tiny.loss_fn, batch, backend=backend, compile_in=compile_in)(*batch)
    else:  # eager too: autograd's engine and its thread pool start on the first backward
        _torch_step(framework, tiny, pe.optim.SGD(lr=0.1), {"0.weight"})(*batch)
    gc.collect()


def _planned_train_bytes(graph: Any) -> int:
    """The static plan's training memory, comparable with the measured one: the arena of
    non-persistent values plus optimizer state and constants (the weights are in the base)."""
    from pockengine.plan.memory import plan_memory

    plan = plan_memory(graph)
    return int(plan.arena_bytes + plan.state_bytes + plan.const_bytes)


def _torch_optimizer(opt: Any, params: list[Any]) -> Any:
    import torch

    import pockengine as pe

    if isinstance(opt, pe.optim.SGD):
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum,
                               weight_decay=opt.weight_decay, nesterov=opt.nesterov)  # fmt: skip
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             weight_decay=opt.weight_decay)  # fmt: skip


def _torch_step(framework: str, work: Any, optimizer: Any, trained: set[str]) -> Any:
    import torch

    model = work.model
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    opt = _torch_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    forward = torch.compile(model) if framework == "torch-compile" else model

    def step(*batch: Any) -> float:
        opt.zero_grad(set_to_none=True)
        loss = work.loss_fn(forward, *batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def run_case(
    workload: str, scheme_name: str, framework: str, steps: int, warmup: int,
    compile_in: str = "process", in_place: bool = False, flops: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One case, as the device sees it. Training memory is the whole-process peak RSS (over
    compiling, warm-up and the measured steps: nothing is released or reset before it is
    read) minus the RSS once the framework is imported (``_load_framework``) and the
    weights and batch are loaded. PockEngine copying the params it trains, the torch
    module is dropped after compiling, so every framework trains with one copy of the
    weights; in place it is kept, as eager keeps it. Beside it, the steady-state step
    memory: the peak over the measured steps alone (the peak counter reset after
    warm-up), minus the same base.
    ``compile_in="child"``: PockEngine compiles in a forked child
    (``pockengine.step.child``), so this process holds nothing the compiler used.
    ``in_place``: PockEngine trains the module's own tensors (``pe.compile(...,
    in_place=True)``), as eager does, and the module stays alive through the steps."""
    import gc

    import torch

    import pockengine as pe

    if framework == "ort-training":
        return _ort_training_case(workload, scheme_name, steps, warmup)
    _load_framework(framework, compile_in)
    work, optimizer, scheme, trained = _case(workload, scheme_name)
    batch = work.make_batch(0)
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    if framework.startswith("pockengine"):
        backend = framework.split("-", 1)[1]
        step: Any = pe.compile(work.model, work.loss_fn, batch, optimizer, scheme,
                               backend=backend, compile_in=compile_in,
                               in_place=in_place)  # fmt: skip
        compile_s = time.perf_counter() - start
        if not in_place:
            model, work.model = work.model, None
            del model
    else:
        step = _torch_step(framework, work, optimizer, trained)
        compile_s = 0.0
    times = []
    faults: list[int] = []
    cpu: list[float] = []  # user + system seconds, all threads: a loaded machine stretches
    loss = 0.0  # them far less than the wall time
    whole = 0
    with torch.no_grad() if framework.startswith("pockengine") else contextlib.nullcontext():
        for i in range(warmup + steps):
            if i == warmup:  # the whole-process peak so far, then the steady state's alone
                whole = _rss_kib("VmHWM")
                _reset_peak()
            before = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            loss = step(*batch)
            dt = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_SELF)
            if i == 0 and framework == "torch-compile":
                compile_s = dt
            if i >= warmup:
                times.append(dt)
                faults.append(after.ru_minflt - before.ru_minflt)
                cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    steady = _rss_kib("VmHWM")
    peak = max(whole, steady)
    median = statistics.median(times)
    # the plan is the benchmark's figure, not the step's: made once the peak is read
    planned = _planned_train_bytes(step.graph) if framework.startswith("pockengine") else None
    del step
    gc.collect()
    count = _analytic_flops(workload, scheme_name) if flops else None
    return {
        "workload": workload, "scheme": scheme_name, "framework": framework,
        "step_ms": median * 1e3, "compile_s": compile_s, "loss": loss,
        "train_mem_mib": (peak - base) / 1024, "peak_rss_mib": peak / 1024,
        "step_mem_mib": (steady - base) / 1024, "base_rss_mib": base / 1024,
        "gflop": None if count is None else count / 1e9,
        "gflops": None if count is None else count / median / 1e9,
        "faults_per_step": statistics.median(faults), "cpu_ms": statistics.median(cpu) * 1e3,
        "planned_train_mib": None if planned is None else planned / 2**20,
        "compile_in": compile_in if framework.startswith("pockengine") else None,
        "in_place": in_place if framework.startswith("pockengine") else None,
    }  # fmt: skip


def _ort_training_case(workload: str, scheme_name: str, steps: int, warmup: int) -> dict[str, Any]:
    """ONNX Runtime Training in its venv (ort_training_peer.py), with the same FLOP count."""
    import torch

    work, optimizer, _, trained = _case(workload, scheme_name)
    eager = _torch_step("torch-eager", work, optimizer, trained)
    batch = work.make_batch(0)
    reference = [eager(*batch) for _ in range(2)]  # the first two torch-eager losses
    del eager, work
    result = ort_training_peer.run_case(workload, scheme_name, steps, warmup,
                                        torch.get_num_threads(), reference)  # fmt: skip
    flops = _analytic_flops(workload, scheme_name)
    return {"workload": workload, "scheme": scheme_name, "framework": "ort-training", **result,
            "gflop": flops / 1e9, "gflops": flops / (result["step_ms"] / 1e3) / 1e9,
            "planned_train_mib": None}  # fmt: skip


def _subprocess(args: list[str], threads: int) -> dict[str, Any]:
    try:
        return run_child([__file__, *args], threads)
    except ChildFailedError as e:
        return {"error": e.last_line}


_MEDIANS = ("step_ms", "compile_s", "train_mem_mib", "step_mem_mib", "peak_rss_mib", "base_rss_mib",
            "cpu_ms", "faults_per_step")  # fmt: skip


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case run in ``--repeat`` separate processes: the median of each measured figure
    (step time and memory move by 10-25% between processes here), every run kept."""
    failed = [r for r in runs if "error" in r]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    out = dict(runs[0])
    for key in _MEDIANS:
        if all(key in r for r in runs):  # (the artifact and ort-training rows have fewer)
            out[key] = statistics.median(r[key] for r in runs)
    if out.get("gflop") is not None:
        out["gflops"] = out["gflop"] / (out["step_ms"] / 1e3)
    out["runs"] = [{k: r[k] for k in ("step_ms", "train_mem_mib")} for r in runs]
    return out


def _label(row: dict[str, Any]) -> str:
    """The framework, where PockEngine compiled when not in the measured process, and
    whether it trained the module's tensors in place."""
    notes = [text for key, value, text in (("compile_in", "child", "compiled in a child"),
                                           ("in_place", True, "in place"))
             if row.get(key) == value]  # fmt: skip
    return f"{row['framework']} ({', '.join(notes)})" if notes else str(row["framework"])


def markdown(results: list[dict[str, Any]], attainable: float) -> str:
    lines = [
        f"Attainable fp32 matmul rate in this run: {attainable:.0f} GFLOP/s.",
        "",
        "| workload | scheme | framework | step ms | GFLOP/s (share) | train MiB (planned) "
        "| steady MiB | peak RSS MiB | compile s | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['scheme']} | {r['framework']} | error: "
                         f"{r['error'][:80]} | | | | | | |")  # fmt: skip
            continue
        share = r["gflops"] / attainable if attainable and r.get("gflops") is not None else 0.0
        rate = "n/a" if r.get("gflops") is None else f"{r['gflops']:.0f} ({share:.0%})"
        planned = r.get("planned_train_mib")
        mem = f"{r['train_mem_mib']:.0f}" + ("" if planned is None else f" ({planned:.0f})")
        # ort-training rows: its first two losses against torch eager's (ort_training_peer.py)
        check = f" (vs eager: {r['loss_check']})" if "loss_check" in r else ""
        lines.append(
            f"| {r['workload']} | {r['scheme']} | {_label(r)} | {r['step_ms']:.0f} "
            f"| {rate} | {mem} | {r.get('step_mem_mib', 0):.0f} "
            f"| {r['peak_rss_mib']:.0f} | {r['compile_s']:.1f} | {r['loss']:.4f}{check} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES))
    parser.add_argument("--frameworks", nargs="*", default=list(FRAMEWORKS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1,
                        help="processes per case; figures are their medians")  # fmt: skip
    parser.add_argument(
        "--out",
        help="also write the Markdown table to this file (replaced whole; the table is "
        "always printed). The docs' tables come from the JSON: benchmarks/docs_tables.py",
    )
    parser.add_argument(
        "--json",
        default=str(ROOT / "benchmarks" / "results" / "step_bench.json"),
        help="results JSON (default: benchmarks/results/step_bench.json)",
    )
    parser.add_argument("--compile-in", choices=("process", "child"), default="process",
                        help="where the in-process PockEngine frameworks compile: in "
                        "the measured process, or in a forked child (compile_fork)")  # fmt: skip
    parser.add_argument("--in-place", action="store_true",
                        help="the in-process PockEngine frameworks train the module's own "
                        "tensors (pe.compile(..., in_place=True)), as eager does; default: "
                        "the step copies the params it trains")  # fmt: skip
    parser.add_argument("--no-flops", action="store_true",
                        help="no analytic FLOP count (it compiles each case again)")  # fmt: skip
    parser.add_argument("--case", nargs=3, metavar=("WORKLOAD", "SCHEME", "FRAMEWORK"))
    parser.add_argument("--matmul", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case and args.case[2].endswith(step_artifact.SUFFIX):  # no torch import here
        w, scheme, framework = args.case
        row = step_artifact.run_case(w, scheme, framework, args.steps, args.warmup, args.threads)
        print(json.dumps(row))
        return 0
    if args.case or args.matmul:
        _threads(args.threads)
        result = ({"gflops": _matmul_gflops()} if args.matmul
                  else run_case(*args.case, steps=args.steps, warmup=args.warmup,
                                compile_in=args.compile_in, in_place=args.in_place,
                                flops=not args.no_flops))  # fmt: skip
        print(json.dumps(result))
        return 0
    attainable = _subprocess(["--matmul", "--threads", str(args.threads)], args.threads)
    venv_error = ort_training_peer.ensure_venv() if "ort-training" in args.frameworks else None
    results = []
    for w in args.workloads:
        for s in args.schemes:
            for f in args.frameworks:
                if f == "ort-training" and venv_error:
                    results.append({"workload": w, "scheme": s, "framework": f,
                                    "error": f"venv: {venv_error}"})  # fmt: skip
                    continue
                case = ["--case", w, s, f, "--steps", str(args.steps), "--warmup",
                        str(args.warmup), "--threads", str(args.threads),
                        "--compile-in", args.compile_in,
                        *(["--in-place"] if args.in_place else []),
                        *(["--no-flops"] if args.no_flops else [])]  # fmt: skip
                runs = [_subprocess(case, args.threads) for _ in range(args.repeat)]
                r = {"workload": w, "scheme": s, "framework": f, **_combine(runs)}
                print(json.dumps(r), file=sys.stderr)
                results.append(r)
    rate = float(attainable.get("gflops", 0.0))
    command = " ".join(["python benchmarks/step_bench.py", *sys.argv[1:]])
    payload = {"command": command, "attainable_gflops": rate, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=1))
    table = markdown(results, rate)
    if args.out:
        Path(args.out).write_text("# Training-step benchmark\n\n" + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
