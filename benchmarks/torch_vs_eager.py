"""The torch backend's default step against PyTorch eager, case by case, in pairs.

    python benchmarks/torch_vs_eager.py                        # every case, 2 threads, 2 pairs
    python benchmarks/torch_vs_eager.py --threads 1 --pairs 1 --cases mbv2:sparse mcu:full
    python benchmarks/torch_vs_eager.py --threads 2 --lockstep 12 --cases llama:sparse

Cases: the benchmark workloads (``zoo.benchmark``: MobileNetV2 width 1.0 at 128 px batch 8,
a 6-layer BERT, an 8-layer LLaMA) and ``mcu``, MobileNetV2 width 0.35 at 128 px batch 1,
each under the schemes sparse, full and head (``zoo.benchmark_schemes``; the mcu case takes
MobileNetV2's). Every run is its own process; a pair is one run of ``ours`` (``pe.compile``
with ``backend="torch"``, default options, compiled where ``pe.compile`` compiles by
default) and one of ``eager`` (autograd and ``torch.optim`` on the same weights, frozen set
and batch), the order alternating from pair to pair. Per run: the median step time of
``--steps`` steps after ``--warmup``, training memory (the whole-process peak RSS minus the
RSS once the framework is loaded and the weights and batch exist: nothing is released
before the peak is read) and the minor page faults of a steady step (median). Per case:
the ratios ours/eager of each pair and their median.

``--lockstep ROUNDS``: per case, one process of each engine kept alive side by side,
stepping in turn (one step of ours, one of eager, the order alternating from round to
round; the process not stepping waits on a pipe), so both see the same load, round after
round: per round the ratios ours/eager of the wall and CPU times, and their medians.
Memory is still each process's own.

Writes benchmarks/results/torch_vs_eager-<threads>t.json (``-lockstep`` added to the name
with ``--lockstep``; after each case) and prints a Markdown table; ``--table FILE`` prints
the table of a results file again. Beside wall time,
each run reports its CPU time a step (user + system, all threads), which a loaded machine
stretches far less than the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import ChildFailedError, child_env, run_child, utc_now, vm_kib, write_results

WORKLOADS = ("mbv2", "bert", "llama", "mcu")
SCHEMES = ("sparse", "full", "head")
CASES = tuple(f"{w}:{s}" for w in WORKLOADS for s in SCHEMES)
ENGINES = ("ours", "eager")


def _workload(name: str) -> tuple[Any, Any, dict[str, Any]]:
    """A fresh workload, its optimizer and its schemes by name."""
    import pockengine as pe
    from pockengine import zoo

    if name == "mcu":
        work = zoo.mobilenet_v2(width=0.35, batch=1, size=128, classes=10)
        return work, pe.optim.SGD(lr=0.01, momentum=0.9), zoo.benchmark_schemes("mbv2")
    work, optimizer = zoo.benchmark(name)
    return work, optimizer, zoo.benchmark_schemes(name)


def _usage() -> tuple[int, float]:
    """Minor page faults and CPU seconds (user + system, all threads) of this process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


class _Setup:
    """One engine's step on one case in this (fresh) process, ready to run."""

    def __init__(self, case: str, engine: str) -> None:
        import step_bench

        import pockengine as pe
        from pockengine.frontend.torch import torch_model_info

        workload, scheme_name = case.split(":")
        step_bench._load_framework("pockengine-torch" if engine == "ours" else "torch-eager")
        work, optimizer, schemes = _workload(workload)
        scheme = schemes[scheme_name]
        self.case, self.engine, self.batch = case, engine, work.make_batch(0)
        self.base = vm_kib("VmRSS")
        if engine == "ours":
            self.step: Any = pe.compile(
                work.model, work.loss_fn, self.batch, optimizer, scheme, backend="torch"
            )
            work.model = None  # the step holds what it trains; frozen weights are shared
        else:
            trained = set(scheme.resolve(torch_model_info(work.model)).names)
            self.step = step_bench._torch_step("torch-eager", work, optimizer, trained)

    def once(self) -> tuple[float, int, float]:
        """One step: its wall seconds, minor page faults and CPU seconds."""
        import torch

        (faults0, cpu0), start = _usage(), time.perf_counter()
        with torch.no_grad() if self.engine == "ours" else contextlib.nullcontext():
            self.step(*self.batch)
        wall = time.perf_counter() - start
        faults1, cpu1 = _usage()
        return wall, faults1 - faults0, cpu1 - cpu0

    def memory(self) -> dict[str, Any]:
        """Training memory so far: the peak RSS minus the RSS before the step was made."""
        import torch

        peak = vm_kib("VmHWM")
        return {"case": self.case, "engine": self.engine, "train_mib": (peak - self.base) / 1024,
                "peak_rss_mib": peak / 1024, "base_rss_mib": self.base / 1024,
                "threads": torch.get_num_threads()}  # fmt: skip


def _run(case: str, engine: str, steps: int, warmup: int) -> dict[str, Any]:
    """One run in this (fresh) process."""
    setup = _Setup(case, engine)
    measured = [setup.once() for _ in range(warmup + steps)][warmup:]
    return {**setup.memory(), "step_ms": statistics.median(m[0] for m in measured) * 1e3,
            "faults_per_step": statistics.median(m[1] for m in measured),
            "cpu_ms": statistics.median(m[2] for m in measured) * 1e3}  # fmt: skip


def _serve(case: str, engine: str, warmup: int) -> None:
    """A lockstep child: set up, warm up, then one step per ``step`` line on stdin, its
    figures as a JSON line each; at ``end``, the memory figures."""
    setup = _Setup(case, engine)
    for _ in range(warmup):
        setup.once()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        wall, faults, cpu = setup.once()
        print(json.dumps({"step_ms": wall * 1e3, "faults": faults, "cpu_ms": cpu * 1e3}),
              flush=True)  # fmt: skip
    print(json.dumps(setup.memory()), flush=True)


def _lockstep(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.lockstep`` rounds of ``case``: both engines' processes alive, stepping in turn."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for engine in ENGINES:  # one set up at a time
            argv = [sys.executable, __file__, "--serve", case, engine, "--warmup", str(args.warmup),
                    "--threads", str(args.threads)]  # fmt: skip
            procs[engine] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True, env=child_env(args.threads))  # fmt: skip
            _reply(procs[engine], engine)
        steps: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
        for k in range(args.lockstep):
            for engine in ENGINES if k % 2 == 0 else ENGINES[::-1]:
                _send(procs[engine], "step")
                steps[engine].append(_reply(procs[engine], engine))
        memory = {}
        for engine in ENGINES:
            _send(procs[engine], "end")
            memory[engine] = _reply(procs[engine], engine)
            procs[engine].wait()
    except ChildFailedError as e:
        return {"case": case, "error": str(e)}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ours, eager = steps["ours"], steps["eager"]
    ratios = {key: [o[key] / e[key] for o, e in zip(ours, eager, strict=True)]
              for key in ("step_ms", "cpu_ms")}  # fmt: skip
    runs = {e: [{**memory[e], **{key: statistics.median(s[key] for s in steps[e])
                                  for key in ("step_ms", "cpu_ms")},
                 "faults_per_step": statistics.median(s["faults"] for s in steps[e])}]
            for e in ENGINES}  # fmt: skip
    return {"case": case, "time_ratio": statistics.median(ratios["step_ms"]),
            "time_ratios": ratios["step_ms"], "cpu_ratio": statistics.median(ratios["cpu_ms"]),
            "cpu_ratios": ratios["cpu_ms"],
            "mem_ratio": memory["ours"]["train_mib"] / memory["eager"]["train_mib"],
            "mem_ratios": [memory["ours"]["train_mib"] / memory["eager"]["train_mib"]],
            "runs": runs, "steps": steps}  # fmt: skip


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _reply(proc: subprocess.Popen[str], engine: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise ChildFailedError([engine], f"{engine} exited ({proc.wait()})")
    return dict(json.loads(line))


def _pairs(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.pairs`` pairs of runs of ``case``, the order alternating; ratios per pair."""
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for k in range(args.pairs):
        for engine in ENGINES if k % 2 == 0 else ENGINES[::-1]:
            argv = [__file__, "--child", case, engine, "--steps", args.steps,
                    "--warmup", args.warmup, "--threads", args.threads]  # fmt: skip
            try:
                runs[engine].append(run_child(argv, args.threads))
            except ChildFailedError as e:
                return {"case": case, "error": f"{engine}: {e.last_line}"}
    ours, eager = runs["ours"], runs["eager"]
    time_ratios = [o["step_ms"] / e["step_ms"] for o, e in zip(ours, eager, strict=True)]
    mem_ratios = [o["train_mib"] / e["train_mib"] for o, e in zip(ours, eager, strict=True)]
    return {"case": case, "time_ratio": statistics.median(time_ratios),
            "time_ratios": time_ratios, "mem_ratio": statistics.median(mem_ratios),
            "mem_ratios": mem_ratios, "runs": runs}  # fmt: skip


def _cell(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    return "/".join(format(r[key], fmt) for r in runs)


def _spread(ratios: list[float]) -> str:
    """A few ratios each, or the range of many."""
    if len(ratios) <= 4:
        return ", ".join(f"{x:.2f}" for x in ratios)
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | step ms ours / eager | ours/eager step | CPU ms a step ours / eager "
             "| training MiB ours / eager | ours/eager memory "
             "| whole-process peak MiB ours / eager | faults a step ours / eager |",
             "|---|---|---:|---|---|---:|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} | | | | | | |")
            continue
        o, e = r["runs"]["ours"], r["runs"]["eager"]
        cpu = (
            "n/a"
            if "cpu_ms" not in o[0]
            else f"{_cell(o, 'cpu_ms', '.0f')} / {_cell(e, 'cpu_ms', '.0f')}"
        )
        if "cpu_ratio" in r:
            cpu += f" (**{r['cpu_ratio']:.2f}x**: {_spread(r['cpu_ratios'])})"
        lines.append(
            f"| {r['case']} | {_cell(o, 'step_ms', '.0f')} / {_cell(e, 'step_ms', '.0f')} "
            f"| **{r['time_ratio']:.2f}x** ({_spread(r['time_ratios'])}) "
            f"| {cpu} | {_cell(o, 'train_mib', '.0f')} / {_cell(e, 'train_mib', '.0f')} "
            f"| **{r['mem_ratio']:.2f}x** "
            f"| {_cell(o, 'peak_rss_mib', '.0f')} / {_cell(e, 'peak_rss_mib', '.0f')} "
            f"| {_cell(o, 'faults_per_step', '.0f')} / {_cell(e, 'faults_per_step', '.0f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="*", default=list(CASES), metavar="WORKLOAD:SCHEME")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", metavar="JSON", help="print the table of a results file")
    parser.add_argument("--lockstep", type=int, default=0, metavar="ROUNDS",
                        help="both engines' processes side by side, stepping in turn")  # fmt: skip
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    if args.child or args.serve:
        import torch

        torch.set_num_threads(args.threads)
        if args.serve:
            _serve(*args.serve, warmup=args.warmup)
        else:
            print(json.dumps(_run(*args.child, steps=args.steps, warmup=args.warmup)))
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {' '.join(CASES)}")
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    payload = {"command": " ".join(["python benchmarks/torch_vs_eager.py", *sys.argv[1:]]),
               "started": utc_now(), "threads": args.threads, "pairs": args.pairs,
               "lockstep": args.lockstep, "steps": args.steps, "warmup": args.warmup,
               "load_before": load, "rows": rows}  # fmt: skip
    name = f"torch_vs_eager-{args.threads}t" + ("-lockstep" if args.lockstep else "")
    for case in args.cases:
        rows.append(_lockstep(case, args) if args.lockstep else _pairs(case, args))
        rows[-1]["load_after"] = os.getloadavg()
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("runs", "steps")}),
              file=sys.stderr)  # fmt: skip
        payload.update(finished=utc_now(), load_after=os.getloadavg())
        write_results(name, payload)  # after each case
    runs = f"{args.lockstep} lockstep rounds" if args.lockstep else f"{args.pairs} pairs"
    print(
        f"{args.threads} threads, {runs}; load average {load[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)\n"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
