"""The benchmark tables of the README and the docs, generated from benchmarks/results/*.json.

    python benchmarks/docs_tables.py           # rewrite every table between its markers
    python benchmarks/docs_tables.py --check   # exit 1 if a committed table is not current

Each table stands between two marker comments in its Markdown file
(``<!-- table:NAME:start -->`` ... ``<!-- table:NAME:end -->``, or the markers the
benchmark scripts write themselves), so the prose around it stays hand-written and no figure
is typed by hand. Every table names the command that produced its JSON: the one the JSON
stores, or one rebuilt from the options it stores, or, for results that store neither, the
command kept in ``_COMMANDS`` below. Only current results are shown: ``TABLES`` names the
JSON file of each table; older runs of a benchmark may stay in results/ unshown.
Standard library only (the table code of ``finetune_table``, ``quality_table`` and
``federated_table`` is reused, so a table written by those scripts is the same text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import federated_table
import finetune_table
import quality_table
import sparse_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# Results that store no command: the command that wrote each (as the benchmark's options
# were then; the script's --help lists them).
_COMMANDS = {
    "step_bench-s11-torch-inplace-kept.json": (
        "OMP_NUM_THREADS=1 python benchmarks/step_bench.py --workloads mbv2 bert "
        "--schemes full bias-only sparse head --frameworks pockengine-torch torch-eager "
        "--in-place --compile-in child --threads 1 --steps 5 --warmup 2 "
        "--json benchmarks/results/step_bench-s11-torch-inplace-kept.json"
    ),
    "step_bench-s11-llama-torch-inplace-kept.json": (
        "OMP_NUM_THREADS=1 python benchmarks/step_bench.py --workloads llama "
        "--schemes full bias-only sparse head --frameworks pockengine-torch torch-eager "
        "--in-place --compile-in child --threads 1 --steps 5 --warmup 2 "
        "--json benchmarks/results/step_bench-s11-llama-torch-inplace-kept.json"
    ),
    "sparse_table.json": "python benchmarks/sparse_table.py",
    "remat_budget.json": (
        "OMP_NUM_THREADS=1 python benchmarks/remat_budget.py --layers 8 --steps 5 "
        "--fractions 1 0.75 0.5 0.25"
    ),
    "device_footprint-1thread.json": (
        "python benchmarks/device_footprint.py --threads 1 "
        "--out benchmarks/results/device_footprint-1thread.json"
    ),
}

# Options a results file stores that are not options of the command line.
_NOT_OPTIONS = {"child", "prepare", "artifact", "doc", "results", "collect_only"}


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def command_of(name: str) -> str:
    """The command that produced the results file ``name``."""
    if name in _COMMANDS:
        return _COMMANDS[name]
    data = load(name)
    if name.startswith("finetune_table-"):
        return finetune_table._command(_finetune_args(data))
    if isinstance(data, dict) and isinstance(data.get("command"), str):
        return str(data["command"])
    if isinstance(data, dict) and isinstance(data.get("args"), dict):
        script = name.removesuffix(".json").split("-", 1)[0]
        return rebuilt_command(f"python benchmarks/{script}.py", data["args"])
    raise KeyError(f"{name}: no command stored; add it to _COMMANDS")


def rebuilt_command(program: str, args: dict[str, Any]) -> str:
    """``program`` with every option ``args`` holds a value for (None and False: left
    out, as the script's own default then applied)."""
    parts = [program]
    for key, value in args.items():
        if key in _NOT_OPTIONS or value is None or value is False or value == "None":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(" ".join([flag, *map(str, value)]))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def generated_by(*names: str) -> str:
    """The sentence that names a table's results files and the commands that wrote them."""
    commands = list(dict.fromkeys(command_of(n) for n in names))
    files = ", ".join(f"`benchmarks/results/{n}`" for n in names)
    each = "each " if len(names) > 1 and len(commands) == 1 else ""
    return (
        f"Generated from {files}, {each}written by "
        + " and ".join(f"`{c}`" for c in commands)
        + "."
    )


def _markdown_table(
    header: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[str]]
) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _align(n_text: int, n_num: int) -> list[str]:
    return ["---"] * n_text + ["---:"] * n_num


# --- fine-tuning, quality, federated: the benchmark scripts' own table code -------------


def _finetune_args(data: dict[str, Any]) -> argparse.Namespace:
    """The options a finetune_table results file stores: each as text ("None" where it was
    not given); results from before --frozen-dtype existed ran with float32 frozen weights."""
    stored = {k: None if v == "None" else v for k, v in data["args"].items()}
    return argparse.Namespace(**{"frozen_dtype": "none", **stored})


def finetune(recipe: str) -> Callable[[], str]:
    def render() -> str:
        data = load(f"finetune_table-{recipe}.json")
        return finetune_table._table(data["rows"], _finetune_args(data))

    return render


def quality(tag: str) -> Callable[[], str]:
    def render() -> str:
        data = load(f"quality_table-{tag}.json")
        return quality_table.markdown(data["rows"], data["command"])

    return render


def federated(recipe: str) -> Callable[[], str]:
    def render() -> str:
        lines = federated_table.table(load(f"federated-{recipe}.json")).splitlines()
        return "\n".join(lines[1:-1])  # without its markers: the caller's stay

    return render


# --- tables this script renders ---------------------------------------------------------

_STEP_MEMORY = (
    "step_bench-s11-torch-inplace-kept.json",
    "step_bench-s11-llama-torch-inplace-kept.json",
)


def sparse() -> str:
    """The compile-time cost of each scheme on the benchmark workloads."""
    name = "sparse_table.json"
    return "\n".join([generated_by(name), "", sparse_table.markdown(load(name))])


def estimator() -> str:
    """How well the gradient estimate ranks the weights against short fine-tunes of each."""
    name = "estimator_vs_finetune-minilm-bbc.json"
    data = load(name)
    rows = [
        [r["score"], str(r["batches"]), f"{r['spearman']:.3f}",
         f"{r['spearman_per_byte']:.3f}", f"{r['seconds']:.1f}"]
        for r in sorted(data["rows"], key=lambda r: (r["score"], r["batches"]))
    ]  # fmt: skip
    rows.append(["fine-tune analysis", "", "1", "1", f"{data['finetune_seconds']:.0f}"])
    header = ("estimate", "backward passes", "Spearman with the fine-tune contributions",
              "per byte of extra memory", "seconds")  # fmt: skip
    return "\n".join([generated_by(name), "", _markdown_table(header, _align(1, 4), rows)])


def remat_budget() -> str:
    """Planned and measured peak, recomputation and step time per memory budget."""
    name = "remat_budget.json"
    rows = []
    for r in load(name)["rows"]:
        budget = "none" if r["budget_mib"] is None else f"{r['budget_mib']:.0f} MiB"
        met = "yes" if r["met"] else "no"
        extra = f"{r['extra_gflop']:.1f} GFLOP ({r['extra_share']:.1%})" if r["segments"] else "0"
        rows.append([budget, f"{r['planned_peak_mib']:.1f}", met, extra, str(r["segments"]),
                     f"{r['vmhwm_mib']:.0f}", f"{r['step_s']:.2f}"])  # fmt: skip
    header = ("budget", "planned peak (MiB)", "met", "recomputed (share of step FLOPs)",
              "segments", "peak RSS (MiB)", "step (s)")  # fmt: skip
    return "\n".join([generated_by(name), "", _markdown_table(header, _align(1, 6), rows)])


def finetune_summary() -> str:
    """Each recipe's validation metric under every scheme, and sparse's step against full's."""
    names = {"minilm-bbc": "accuracy", "minilm-tweets": "accuracy",
             "lite0-fashion": "accuracy", "smollm2-pydocs": "perplexity"}  # fmt: skip
    rows = []
    for recipe, metric in names.items():
        by = {r["scheme"]: r for r in load(f"finetune_table-{recipe}.json")["rows"]}
        fmt = ".3f" if metric == "accuracy" else ".2f"
        cells = [format(by[s]["value"], fmt) for s in ("full", "bias", "sparse", "head")]
        ratio = by["sparse"]["step_s"] / by["full"]["step_s"]
        rows.append([recipe, metric, *cells, f"{ratio:.2f}"])
    header = ("recipe", "metric", "full", "bias", "sparse (recipe)", "head",
              "sparse step / full step")  # fmt: skip
    files = [f"finetune_table-{r}.json" for r in names]
    return "\n".join([generated_by(*files), "", _markdown_table(header, _align(2, 5), rows)])


def step_memory() -> str:
    """Training memory of the torch backend against eager, per workload and scheme."""
    results = [r for name in _STEP_MEMORY for r in load(name)["results"]]
    cases = dict.fromkeys((r["workload"], r["scheme"]) for r in results)
    rows = []
    for workload, scheme in cases:
        by = {
            r["framework"]: r for r in results if (r["workload"], r["scheme"]) == (workload, scheme)
        }
        ours, eager = by["pockengine-torch"], by["torch-eager"]
        rows.append([
            workload, scheme, f"{eager['train_mem_mib']:.1f}", f"{ours['train_mem_mib']:.1f}",
            f"{ours['train_mem_mib'] / eager['train_mem_mib']:.2f}",
            f"{ours['planned_train_mib']:.1f}",
            f"{eager['peak_rss_mib']:.0f} / {ours['peak_rss_mib']:.0f}",
        ])  # fmt: skip
    header = ("workload", "scheme", "eager (MiB)", "torch backend, in place (MiB)",
              "ours / eager", "plan (MiB)", "whole-process peak: eager / ours (MiB)")  # fmt: skip
    return "\n".join([generated_by(*_STEP_MEMORY), "", _markdown_table(header, _align(2, 5), rows)])


def step_c() -> str:
    """Step time and training memory of the C and torch backends against eager."""
    name = "step_bench-c-1thread.json"
    data = load(name)
    rows = [
        [r["workload"], r["scheme"], r["framework"], f"{r['step_ms']:.0f}",
         f"{r['train_mem_mib']:.1f}",
         "" if r["planned_train_mib"] is None else f"{r['planned_train_mib']:.1f}",
         f"{r['peak_rss_mib']:.0f}"]
        for r in data["results"]
    ]  # fmt: skip
    header = ("workload", "scheme", "framework", "step (ms)", "training (MiB)", "plan (MiB)",
              "whole-process peak (MiB)")  # fmt: skip
    return "\n".join(
        [
            f"{generated_by(name)} {data['threads']} thread(s).",
            "",
            _markdown_table(header, _align(3, 4), rows),
        ]
    )


_TORCH_VS_EAGER = (
    "step_bench-torch-vs-eager-1thread.json",
    "step_bench-torch-vs-eager-2thread.json",
)


def _ours_eager(ours: dict[str, Any], eager: dict[str, Any], key: str, fmt: str) -> list[str]:
    """``ours / eager`` and their ratio, of one figure."""
    pair = f"{format(ours[key], fmt)} / {format(eager[key], fmt)}"
    return [pair, f"{ours[key] / eager[key]:.2f}" if eager[key] else "n/a"]


def torch_vs_eager() -> str:
    """The torch backend's default step against eager: time, CPU time, memory, faults."""
    rows = []
    for name in _TORCH_VS_EAGER:
        threads = name.rsplit("-", 1)[1].split("thread")[0]
        results = load(name)["results"]
        for r in results:
            if r["framework"] != "pockengine-torch":
                continue
            case = (r["workload"], r["scheme"])
            eager = next((e for e in results if e["framework"] == "torch-eager"
                          and (e["workload"], e["scheme"]) == case), None)  # fmt: skip
            if eager is None:  # a run stopped before the case's eager half
                continue
            rows.append([
                r["workload"], r["scheme"], threads, *_ours_eager(r, eager, "step_ms", ".0f"),
                *_ours_eager(r, eager, "cpu_ms", ".0f"),
                *_ours_eager(r, eager, "train_mem_mib", ".1f"),
                f"{r['faults_per_step']:.0f} / {eager['faults_per_step']:.0f}",
            ])  # fmt: skip
    header = ("workload", "scheme", "threads", "step ms: ours / eager", "step ratio",
              "CPU ms a step: ours / eager", "CPU ratio", "training MiB: ours / eager",
              "memory ratio", "minor faults a step: ours / eager")  # fmt: skip
    table = _markdown_table(header, _align(3, 7), rows)
    return "\n".join([generated_by(*_TORCH_VS_EAGER), "", table])


def device_footprint() -> str:
    name = "device_footprint-1thread.json"
    data = load(name)
    rows = [
        [r["case"], f"{r['peak_mib']:.1f}", f"{r['idle_mib']:.1f}", f"{r['step_ms']:.1f}",
         "" if r.get("planned_mib") is None else f"{r['planned_mib']:.2f}"]
        for r in data["rows"]
    ]  # fmt: skip
    header = ("case", "whole-process peak (MiB)", "idle (MiB)", "step (ms)", "plan (MiB)")
    return "\n".join(
        [
            f"{generated_by(name)} {data['threads']} thread(s).",
            "",
            _markdown_table(header, _align(1, 4), rows),
        ]
    )


def c_vs_eager(name: str) -> Callable[[], str]:
    """CPU time a step of the C backend, the torch backend and eager (c_vs_eager.py)."""

    def render() -> str:
        data = load(name)
        rows = []
        for r in data["rows"]:
            if "error" in r:
                continue
            engines = ("c", "torch", "eager")
            cells = [f"{statistics.median(x['cpu_ms'] for x in r['runs'][e]):.1f}" for e in engines]
            rows.append([r["case"], *cells, f"{r['c_eager_cpu']:.2f}", f"{r['c_torch_cpu']:.2f}",
                         f"{r['c_eager_wall']:.2f}"])  # fmt: skip
        header = ("case", "C (CPU ms a step)", "torch backend", "eager", "C / eager",
                  "C / torch backend", "C / eager, wall time")  # fmt: skip
        return "\n".join(
            [
                f"{generated_by(name)} {data['threads']} thread(s).",
                "",
                _markdown_table(header, _align(1, 6), rows),
            ]
        )

    return render


def c_winograd() -> str:
    """The 3x3 kernels against the implicit GEMM, native and portable (c_winograd.py)."""
    names = ("c_winograd-1thread.json", "c_winograd-1thread-portable.json")
    native, portable = (load(n) for n in names)
    rows = []
    for a, b in zip(native["kernels"], portable["kernels"], strict=True):
        ratio = [f"{r['vs_im2col'][k]:.2f}" if k in r["vs_im2col"] else "-"
                 for r in (a, b) for k in ("winograd", "winograd4")]  # fmt: skip
        shape = f"{a['shape']} (batch {a['batch']}, {a['in']}->{a['out']}, {a['side']}px)"
        rows.append([shape, a["op"], f"{a['ms']['im2col']:.2f}", *ratio, a["rule"], b["rule"]])
    header = ("shape", "op", "implicit GEMM, ms", "F(2x2) / GEMM", "F(4x4) / GEMM",
              "portable: F(2x2) / GEMM", "portable: F(4x4) / GEMM", "rule",
              "portable: rule")  # fmt: skip
    steps = [f"{d['step']['ratio']:.2f}x ({label})" for d, label in
             ((native, "native"), (portable, "portable"))]  # fmt: skip
    lines = [
        f"{generated_by(*names)} One thread; times are medians of process CPU time.",
        "",
        _markdown_table(header, [*_align(2, 5), "---", "---"], rows),
        "",
        "VGG-style step with the rule against the rule without F(4x4, 3x3): "
        + ", ".join(steps) + " the CPU time.",
    ]  # fmt: skip
    against = native["step"].get("ratio_portable_rule")
    if against is not None:
        lines[-1] += (" Native, the rule against the portable build's rule (F(2x2, 3x3) "
                      f"wherever it has 32 channels): {against:.2f}x.")  # fmt: skip
    deep = native.get("deep_step")
    if deep is not None:
        lines[-1] += (" ResNet-18's stages as 3x3 convolutions (one image of 56 x 56), native, "
                      f"the same: {deep['ratio_portable_rule']:.2f}x.")  # fmt: skip
    return "\n".join(lines)


def c_strided_grad() -> str:
    """Strided input gradients, col2im against direct loops (c_strided_grad.py)."""
    name = "c_strided_grad-1thread.json"
    data = load(name)
    rows = [[r["shape"], str(r["batch"]), f"{r['side']}px", f"{r['ms']['direct']:.2f}",
             f"{r['ms']['im2col']:.2f}", f"{r['ratio']:.3f}"] for r in data["kernels"]]  # fmt: skip
    header = ("shape (stride 2)", "batch", "input", "direct loops, ms", "col2im, ms", "ratio")
    step = data["step"]
    med = step["median_cpu_s"]
    return "\n".join([
        f"{generated_by(name)} One thread; times are medians of process CPU time.",
        "",
        _markdown_table(header, _align(3, 3), rows),
        "",
        f"{step['model']}: {med['rule'] * 1e3:.1f} ms a step with col2im, "
        f"{med['direct'] * 1e3:.1f} ms with the strided input gradients on direct loops "
        f"({step['ratio']:.2f}x; "
        + ("the same losses to 1e-4)." if step["losses_agree"] else "the losses DIFFER)."),
    ])  # fmt: skip


_LORA_MEMORY = (
    "lora_peer-smollm2-pydocs-workspace-s20-narrow.json",
    "lora_peer-smollm2-pydocs-workspace-s20-narrow2.json",
)
_LORA_SPEED = "lora_speed-smollm2-pydocs-nodropout-s20-ws.json"


def _lora_pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(PEFT's row, ours) of each pair of processes, in the order they ran."""
    pairs = []
    for name in _LORA_MEMORY:
        rows = load(name)["rows"]
        peft = [r for r in rows if r["case"] == "peft"]
        ours = [r for r in rows if r["case"] == "lora-artifact"]
        pairs += list(zip(peft, ours, strict=True))
    return pairs


def lora_memory() -> str:
    rows = [
        [str(i), f"{peft['step_s_median']:.3f}", f"{ours['step_s_median']:.3f}",
         f"{ours['step_s_median'] / peft['step_s_median']:.3f}",
         f"{peft['training_mib']:.0f}", f"{ours['training_mib']:.0f}",
         f"{ours['training_mib'] / peft['training_mib']:.2f}",
         f"{peft['process_peak_rss_mib']:.0f} / {ours['process_peak_rss_mib']:.0f}",
         f"{peft['val_perplexity']:.2f} / {ours['val_perplexity']:.2f}"]
        for i, (peft, ours) in enumerate(_lora_pairs(), 1)
    ]  # fmt: skip
    header = ("pair", "PEFT step (s)", "our step (s)", "ratio", "PEFT training (MiB)",
              "ours (MiB)", "ratio", "whole-process peak, PEFT / ours (MiB)",
              "val perplexity, PEFT / ours")  # fmt: skip
    table = _markdown_table(header, _align(1, 8), rows)
    return "\n".join([generated_by(*_LORA_MEMORY), "", table])


def lora_speed() -> str:
    data = load(_LORA_SPEED)
    rows = [
        [r["variant"], f"{r['step_s_median']:.3f}", f"{r['vs_peft']:.3f}", str(len(r["step_s"]))]
        for r in data["rows"]
    ]
    header = ("variant", "median step (s)", "vs PEFT", "rounds")
    return "\n".join([generated_by(_LORA_SPEED), "", _markdown_table(header, _align(1, 3), rows)])


# --- the README's headline table ----------------------------------------------------------


def _finetune_row(recipe: str) -> list[str]:
    rows = {r["scheme"]: r for r in load(f"finetune_table-{recipe}.json")["rows"]}
    sparse, full = rows["sparse"], rows["full"]
    if sparse["metric"] == "val_accuracy":
        what = f"{recipe}: validation accuracy, sparse recipe vs full fine-tuning"
        figure = f"{sparse['value']:.3f} vs {full['value']:.3f}"
    else:
        what = f"{recipe}: validation perplexity, sparse recipe vs full fine-tuning"
        figure = f"{sparse['value']:.2f} vs {full['value']:.2f}"
    ratio = sparse["step_s"] / full["step_s"]
    return [
        what,
        f"{figure}, at {ratio:.2f}x the step time",
        "[Fine-tuning](docs/finetune.md#evidence-sparse-vs-full-fine-tuning-every-recipe)",
    ]


def _quality_row(tag: str) -> list[str]:
    rows = {r["scheme"]: r for r in load(f"quality_table-{tag}.json")["rows"]}
    auto, full = rows["auto"], rows["full"]
    peak = auto["planned_peak_mib"] / full["planned_peak_mib"]
    return [
        f"{auto['recipe']}: held-out test accuracy over {len(auto['values'])} seeds, "
        "`--scheme auto` vs full",
        f"{auto['mean'] * 100:.1f} vs {full['mean'] * 100:.1f}, at {peak:.2f}x the planned peak",
        "[Quality](docs/quality.md)",
    ]


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def _lora_row() -> list[str]:
    speed = {r["variant"]: r for r in load(_LORA_SPEED)["rows"]}
    pairs = _lora_pairs()
    steps = [o["step_s_median"] / p["step_s_median"] for p, o in pairs]
    memory = [o["training_mib"] / p["training_mib"] for p, o in pairs]
    return [
        "SmolLM2-135M LoRA (rank 8, q/v) against Hugging Face PEFT in eager PyTorch: step "
        "time and training memory",
        f"{speed['lora-ws']['vs_peft']:.2f}x its step in one process; {_span(steps, '.2f')}x "
        f"at {_span(memory, '.2f')}x its training memory in separate processes",
        "[Benchmarks](docs/benchmarks.md#lora-against-hugging-face-peft)",
    ]


def _device_row() -> list[str]:
    rows = {r["case"]: r for r in load("device_footprint-1thread.json")["rows"]}
    c, eager = rows["c-trainer"], rows["torch-eager"]
    return [
        "Stand-alone C trainer, MobileNetV2 sparse step: whole-process peak",
        f"{c['peak_mib']:.1f} MiB (PyTorch eager: {eager['peak_mib']:.0f} MiB)",
        "[Exporting to a device](docs/c_backend.md#device-footprint)",
    ]


def _federated_row(recipe: str) -> list[str]:
    data = load(f"federated-{recipe}.json")
    rows, cmp = data["rows"], data["compare"]
    args = data["args"]
    return [
        f"{recipe} ({args['max_train']} training examples): sparse FedAvg, {args['clients']} "
        f"clients, Dirichlet {args['alpha']}, final accuracy and bytes sent vs full-model FedAvg",
        f"{rows['fed-sparse']['final_accuracy']:.3f} vs {rows['fed-full']['final_accuracy']:.3f}, "
        f"{cmp['up_ratio_vs_full_fedavg']:.3f}x the bytes",
        "[Federated](docs/federated.md#benchmark)",
    ]


def lm_packing() -> str:
    name = "lm_packing.json"
    data = load(name)
    header = ("layout", "rows", "padded tokens", "step (CPU)", "trained tokens/s")
    rows = []
    for layout, label in (("packed", "packed"), ("buckets", "length buckets (`--packing off`)"),
                          ("pad-to-max", "pad-to-max (`--buckets 1`)")):  # fmt: skip
        r = data[layout]
        if layout == "buckets":
            label += f": {len(r['buckets'])} of {', '.join(map(str, r['buckets']))} tokens"
        step, speed = f"{r['step_s'] * 1000:.0f} ms", f"{r['trained_tokens_per_s']:.0f}"
        rows.append([label, str(r["rows"]), f"{r['padded_share']:.1%}", step, speed])
    lo, med, p90, p99, hi = data["lengths"]
    return "\n".join([
        _markdown_table(header, _align(1, 4), rows), "",
        f"Lengths {lo}/{med}/{p90}/{p99}/{hi} tokens (min/median/p90/p99/max). Packing trains "
        f"{data['speedup']:.2f}x pad-to-max's trained tokens a second, buckets "
        f"{data['bucket_speedup']:.2f}x. {generated_by(name)}",
    ])  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


_PYQA = ("pyqa_quality.json", "pyqa_quality-full-auto.json")  # the first: the untrained model


def _one_line(text: str) -> str:
    return " ".join(text.split())


def pyqa_quality() -> str:
    files = [load(name) for name in _PYQA]
    data = {**files[0], "rows": [r for f in files for r in f["rows"]]}
    before = data["before"]
    header = ("scheme", "trained params", "test loss", "test perplexity", "step (wall)",
              "planned peak", "peak RSS")  # fmt: skip
    rows = [["untrained", "0", f"{before['test_loss']:.3f}", f"{before['test_perplexity']:.2f}",
             "", "", ""]]  # fmt: skip
    for r in data["rows"]:
        scheme = r["scheme"] + (f" ({r['auto_scheme']})" if r.get("auto_scheme") else "")
        rows.append([scheme, f"{r['trained_params'] / 1e6:.1f} M", f"{r['test_loss']:.3f}",
                     f"{r['test_perplexity']:.2f}", f"{r['step_s']:.1f} s",
                     _mib(r["planned_peak_bytes"]), _mib(r["peak_rss_bytes"])])  # fmt: skip
    lines = [_markdown_table(header, _align(1, 6), rows), "", generated_by(*_PYQA), ""]
    lines.append("Greedy answers to held-out questions, before and after:")
    for i, prompt in enumerate(data["prompts"]):
        lines += ["", f"- **{prompt['question']}** (the docs: {prompt['reference']})",
                  f"  - untrained: {_one_line(before['generations'][i])}"]  # fmt: skip
        lines += [f"  - {r['scheme']}: {_one_line(r['generations'][i])}" for r in data["rows"]]
    return "\n".join(lines)


def headline() -> str:
    rows = [
        *(
            _finetune_row(r)
            for r in ("minilm-bbc", "minilm-tweets", "lite0-fashion", "smollm2-pydocs")
        ),
        _quality_row("minilm-bbc"),
        _lora_row(),
        _device_row(),
        _federated_row("minilm-bbc"),
    ]
    return _markdown_table(("result", "figure", "command and details"), _align(3, 0), rows)


@dataclass(frozen=True)
class Table:
    path: str  # the Markdown file, from the repository root
    markers: tuple[str, str]
    render: Callable[[], str]


def _ours(path: str, name: str, render: Callable[[], str]) -> Table:
    return Table(path, (f"<!-- table:{name}:start -->", f"<!-- table:{name}:end -->"), render)


def _tagged(path: str, kind: str, tag: str, render: Callable[[], str]) -> Table:
    return Table(path, (f"<!-- {kind}:{tag}:start -->", f"<!-- {kind}:{tag}:end -->"), render)


TABLES: tuple[Table, ...] = (
    _ours("README.md", "headline", headline),
    _ours("docs/finetune.md", "finetune-summary", finetune_summary),
    _ours("docs/passes.md", "remat-budget", remat_budget),
    *(
        _tagged("docs/finetune.md", "finetune-table", r, finetune(r))
        for r in ("minilm-bbc", "lite0-fashion", "minilm-tweets", "smollm2-pydocs")
    ),
    *(
        _tagged("docs/quality.md", "quality", tag, quality(tag))
        for tag in (
            "pydocs-topics",
            "minilm-bbc",
            "minilm-tweets",
            "lite0-fashion-running",
            "lite0-fashion-running-auto",
            "smollm2-pydocs-s15",
            "generic-lora-s19",
            "minilm-bbc-lora-s16",
            "minilm-tweets-lora-s16",
            "pydocs-topics-issue-scale-s20",
        )
    ),
    *(
        _tagged("docs/federated.md", "federated-table", r, federated(r))
        for r in ("minilm-bbc", "lite0-fashion")
    ),
    _ours("docs/llm.md", "lm-packing", lm_packing),
    _ours("docs/llm.md", "pyqa-quality", pyqa_quality),
    _ours("docs/sparse_backprop.md", "sparse", sparse),
    _ours("docs/search.md", "estimator", estimator),
    _ours("docs/benchmarks.md", "step-memory", step_memory),
    _ours("docs/benchmarks.md", "step-c", step_c),
    _ours("docs/benchmarks.md", "torch-vs-eager", torch_vs_eager),
    _ours("docs/benchmarks.md", "lora-memory", lora_memory),
    _ours("docs/benchmarks.md", "lora-speed", lora_speed),
    _ours("docs/c_backend.md", "device-footprint", device_footprint),
    _ours("docs/c_backend.md", "c-winograd", c_winograd),
    _ours("docs/c_backend.md", "c-strided-grad", c_strided_grad),
    _ours("docs/c_backend.md", "c-vs-eager-1thread", c_vs_eager("c_vs_eager-1thread.json")),
    _ours("docs/c_backend.md", "c-vs-eager-2thread", c_vs_eager("c_vs_eager-2thread.json")),
    _ours(
        "docs/c_backend.md",
        "c-vs-eager-resnet18-1thread",
        c_vs_eager("c_vs_eager-resnet18-1thread.json"),
    ),
    _ours(
        "docs/c_backend.md",
        "c-vs-eager-tf-1thread",
        c_vs_eager("c_vs_eager-transformers-1thread.json"),
    ),
    _ours(
        "docs/c_backend.md",
        "c-vs-eager-tf-2thread",
        c_vs_eager("c_vs_eager-transformers-2thread.json"),
    ),
)


def generated(root: Path = ROOT) -> dict[Path, str]:
    """Each Markdown file that holds a table, as it reads with every table current."""
    texts: dict[Path, str] = {}
    for table in TABLES:
        path = root / table.path
        text = texts.get(path) or path.read_text(encoding="utf-8")
        start, end = table.markers
        if text.count(start) != 1 or text.count(end) != 1:
            raise SystemExit(f"{table.path}: expected one {start} and one {end}")
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        texts[path] = f"{head}{start}\n{table.render()}\n{end}{tail}"
    return texts


def stale(root: Path = ROOT) -> list[Path]:
    """The files whose committed tables differ from what the results generate."""
    return [p for p, text in generated(root).items() if p.read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(
                f"{path.relative_to(ROOT)}: tables differ from benchmarks/results", file=sys.stderr
            )
        return 1 if old else 0
    for path, text in generated().items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
