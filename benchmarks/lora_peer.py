"""LoRA peer: Hugging Face PEFT LoRA in PyTorch eager beside our LoRA scheme and our sparse
recipe, on one fine-tuning recipe's model and data, each in its own process.

    python benchmarks/lora_peer.py                                   # minilm-bbc
    python benchmarks/lora_peer.py --recipe smollm2-pydocs --steps 20 --max-train 80

Cases: ``peft`` (``get_peft_model`` with rank 8, alpha 16, the model family's q/v
projections, the head in ``modules_to_save`` where the recipe trains it; ``torch.optim.AdamW``
in eager mode), ``lora`` (``--scheme lora``: the same adapters and head, compiled, torch
backend), ``sparse`` (the recipe's sparse scheme, compiled). Each trains ``--steps`` steps
on the same seeded batches with AdamW under the same warmup + linear-decay schedule (the
adapters at the ``lora`` learning rate, the sparse scheme at its own), then evaluates on the
validation split in torch. The compiled cases drop the torch module's weights once
compiled (the step holds its own copy of every weight, as in step_bench.py). Per case:
median step time, idle RSS (model and data loaded, every weight paged in: Hugging Face
maps safetensors files lazily), peak RSS over the training steps,
their difference (the training memory), the whole process's peak (compiling included: it
holds two copies of the weights a while), and the validation accuracy and loss
(perplexity for a causal LM). ``lora-int8`` is ``lora`` with the frozen weights stored as
int8 (``frozen_dtype="int8"``: QLoRA's idea; PEFT's 4/8-bit path needs bitsandbytes).
``lora-remat`` is ``lora`` compiled with ``memory_budget=--remat-budget`` (block
recomputation chosen by the planner, ``passes.remat_budget``; the row keeps the plan
before and after and the recomputed FLOPs). ``lora-artifact`` and ``lora-remat-artifact``
are compiled and saved (``step.save``) by a child process; the measured process builds
the same model and data, drops the module's weights and loads the step
(``pockengine.load_step``): it never runs the compiler. ``--dropout off`` sets every
dropout probability of the model to 0 in all cases (the recipe's model keeps its own
otherwise). ``--heap keep`` runs every case, PEFT's included, with glibc's heap thresholds
fixed (``backends.torch.keep_freed_heap``: freed memory stays in the heap for reuse, no
page faults to map it again) and the compiled steps with ``TorchBackend(keep_heap=True)``.
``--workspace on`` compiles and loads the steps with ``TorchBackend(workspace=True)`` (the
large results written into one buffer the step keeps; PEFT's case is unchanged).
``--heap-thresholds 2M,8M`` compiles and loads them with
``TorchBackend(heap_thresholds=(2 << 20, 8 << 20))`` (glibc's mmap and trim thresholds
fixed, process-wide, from the step's compile or load on); with ``--thresholds-all`` every
case's process, PEFT's included, fixes them at its start. Writes
benchmarks/results/lora_peer-<recipe>[-nodropout][-remat<budget>][-keepheap][-workspace]
[-heap<mmap>-<trim>[-all]][-<tag>].json (the budget named when it is not the default).

Training memory is defined the same way for every case: the peak RSS over the training
steps minus the idle RSS, and the idle process holds the torch module's weights in every
case. PEFT trains those weights in place; the compiled and loaded cases free them and the
step holds its own copy (read from the artifact in the loaded cases), so the frozen
weights count once in idle and about zero in training for every case.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from _harness import (
    ROOT,
    ChildFailedError,
    add_data_options,
    add_run_options,
    forward,
    reset_peak,
    run_cases,
    run_child,
    vm_mib,
    write_results,
)

CASES = ("peft", "lora", "lora-remat", "lora-artifact", "lora-remat-artifact", "lora-int8",
         "sparse")  # fmt: skip
REMAT_BUDGET = "152MB"  # minilm-bbc 16 x 64: the least planned peak at <= ~20% extra FLOPs
Array = np.ndarray[Any, Any]


class Case(NamedTuple):
    """What a case name asks for: ``lora-remat-artifact`` -> lora, budget, artifact."""

    scheme: str  # "peft", "lora" or "sparse"
    frozen_dtype: str | None
    remat: bool
    artifact: bool

    @classmethod
    def of(cls, name: str) -> Case:
        scheme, *extras = name.split("-")
        frozen = next((e for e in extras if e in ("int8", "int4")), None)
        return cls(scheme, frozen, "remat" in extras, "artifact" in extras)


def _batches(
    train: tuple[Array, ...], batch: int, steps: int, seed: int
) -> Iterator[tuple[Array, ...]]:
    order = np.random.default_rng(seed).permutation(len(train[0]))
    for i in range(steps):
        idx = np.take(order, np.arange(i * batch, (i + 1) * batch), mode="wrap")
        yield tuple(np.ascontiguousarray(a[idx]) for a in train)


def _task(args: argparse.Namespace) -> tuple[Any, Any]:
    from pockengine.tasks import recipes
    from pockengine.tasks.config import FinetuneConfig

    ours = "sparse" if Case.of(args.child).scheme == "sparse" else "lora"
    config = FinetuneConfig(recipe=args.recipe, max_train=args.max_train, max_val=args.max_val,
                            batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                            scheme=ours)  # fmt: skip
    if args.lora_lr is not None and ours != "sparse":
        config.lr = args.lora_lr
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    if args.dropout == "off":
        _no_dropout(task.model)
    for p in task.model.parameters():  # page in the mmapped weights: idle holds the model
        p.detach().sum()
    return config, task


def _no_dropout(model: Any) -> None:
    """Every dropout probability of ``model`` to 0 (modules and attention attributes)."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for attr in ("dropout_prob", "attention_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


def _peft_trainer(task: Any, config: Any, head: bool) -> tuple[Any, Callable[..., float], Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    from pockengine.sparse.lora import DEFAULT_TARGETS

    leaves = {name.rsplit(".", 1)[-1] for name, _ in task.model.named_modules()}
    targets = next(list(pair) for pair in DEFAULT_TARGETS if set(pair) <= leaves)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets,
                      modules_to_save=["head"] if head else None)  # fmt: skip
    model = get_peft_model(task.model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    def train(lr: float, *batch: Array) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = task.loss_fn(model, *(torch.from_numpy(a) for a in batch))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, train, sum(p.numel() for p in params)


_THRESHOLDS: tuple[int, int] | None = None  # --heap-thresholds, set once by main()


def _bytes(text: str) -> int:
    """``2M`` -> 2 << 20, ``64K`` -> 64 << 10, ``4096`` -> 4096."""
    shift = {"K": 10, "M": 20}.get(text[-1:].upper(), 0)
    return int(text[:-1] if shift else text) << shift


def _thresholds(text: str | None) -> tuple[int, int] | None:
    """``--heap-thresholds MMAP,TRIM`` as bytes."""
    if text is None:
        return None
    mmap_bytes, trim_bytes = (_bytes(t) for t in text.split(","))
    return mmap_bytes, trim_bytes


def _backend(heap: str, workspace: str = "off") -> Any:
    """The torch backend; with ``heap="keep"`` one that keeps the freed heap (no trims),
    with ``workspace="on"`` one that writes the large results into a kept workspace, with
    ``--heap-thresholds`` one that fixes glibc's mmap and trim thresholds."""
    from pockengine.backends.torch.backend import TorchBackend

    return TorchBackend(keep_heap=heap == "keep", workspace=workspace == "on",
                        heap_thresholds=_THRESHOLDS)  # fmt: skip


def _compile(
    task: Any, config: Any, case: Case, budget: str | None, heap: str, workspace: str = "off"
) -> Any:
    """The case's step, compiled for the torch backend on the recipe's first batch."""
    import torch

    import pockengine as pe
    from pockengine.tasks import recipes

    scheme = recipes.parse_scheme(case.scheme, config.recipe)
    example = tuple(torch.from_numpy(a[: config.batch_size]) for a in task.train)
    task.model.train()
    return pe.compile(
        task.model,
        task.loss_fn,
        example,
        scheme=scheme,
        backend=_backend(heap, workspace),
        frozen_dtype=case.frozen_dtype,
        memory_budget=budget if case.remat else None,
        optimizer=pe.optim.AdamW(lr=config.lr, weight_decay=config.weight_decay),
    )


def _our_trainer(
    task: Any, config: Any, case: Case, args: argparse.Namespace
) -> tuple[Any, Callable[..., float], Any]:
    """The compiled step (or, with ``args.artifact``, the step loaded from the artifact)
    and its train function; the module's weights are freed: the step holds its own. No
    release helper of the engine's runs before the measurement (the independent
    harness's rule): what glibc keeps of the freed memory counts."""
    import torch

    import pockengine as pe

    step = None
    if not args.artifact:
        step = _compile(task, config, case, args.remat_budget, args.heap, args.workspace)
    for p in task.model.parameters():
        p.data = torch.empty(0)
    if step is None:
        step = pe.load_step(args.artifact, backend=_backend(args.heap, args.workspace))

    def train(lr: float, *batch: Array) -> float:
        step.lr = lr
        return step(*batch)

    return step, train, step.report().ours.trained_elements


def _prepare(args: argparse.Namespace) -> None:
    """Compile the case's step and save it to ``args.prepare`` (the artifact cases)."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config, task = _task(args)
    _compile(task, config, Case.of(args.child), args.remat_budget, args.heap).save(args.prepare)
    print(json.dumps({"prepared": args.prepare}))


def _plan(step: Any) -> dict[str, Any]:
    """The compiled plan of ``step``: planned peak, saved activations, recomputation."""
    report = step.report()
    mib = 2**20
    out: dict[str, Any] = {
        "planned_peak_mib": report.ours.planned_peak_bytes / mib,
        "planned_saved_activations_mib": report.ours.saved_activation_bytes / mib,
        "planned_param_mib": report.ours.param_bytes / mib,
    }
    if report.recomputation is not None:
        out["recomputation"] = {k: v for k, v in report.recomputation.to_dict().items()
                                if k != "segments"}  # fmt: skip
    return out


def _evaluate(model: Any, task: Any) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    model.eval()
    losses, correct, seen = [], 0, 0
    size = 8 if task.kind == "causal-lm" else 64
    with torch.no_grad():
        for i in range(0, len(task.val[0]), size):
            batch = [torch.from_numpy(a[i : i + size]) for a in task.val]
            if task.kind == "causal-lm":
                losses.append(float(task.loss_fn(model, *batch)) * len(batch[0]))
            else:
                logits = model(*batch[:-1])
                losses.append(float(F.cross_entropy(logits, batch[-1], reduction="sum")))
                correct += int((logits.argmax(-1) == batch[-1]).sum())
            seen += len(batch[0])
    out = {"val_loss": sum(losses) / seen}
    if task.kind == "causal-lm":
        out["val_perplexity"] = math.exp(out["val_loss"])
    else:
        out["val_accuracy"] = correct / seen
    return out


def _train(
    train: Callable[..., float],
    task: Any,
    config: Any,
    args: argparse.Namespace,
    peaks: list[float],
) -> tuple[list[float], list[float]]:
    """``args.steps`` steps on the seeded batches under warmup + linear decay: the step
    times and the losses; ``peaks`` gets the peak RSS (MiB) after each step."""
    from pockengine.optim import linear_schedule

    times, losses = [], []
    peaks.clear()
    warmup = round(config.warmup * args.steps)
    for t, batch in enumerate(_batches(task.train, config.batch_size, args.steps, args.seed)):
        lr = linear_schedule(t, float(config.lr), warmup, args.steps)
        tick = time.perf_counter()
        losses.append(train(lr, *batch))
        times.append(time.perf_counter() - tick)
        peaks.append(vm_mib("VmHWM"))
    return times, losses


def _torch_model(step: Any, task: Any) -> Any:
    """The torch module with the step's weights back, adapters merged (for evaluation)."""
    import torch

    from pockengine.sparse.lora import merge_adapters

    state = merge_adapters(step.flat_state_dict(), step.resolution.adapters)
    for name, p in task.model.named_parameters():
        p.data = torch.from_numpy(state[name])
    return task.model


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    case = Case.of(args.child)
    if args.heap == "keep":  # the same allocator settings in every case, PEFT's included
        from pockengine.backends.torch.backend import keep_freed_heap

        keep_freed_heap()
    if _THRESHOLDS is not None and args.thresholds_all:  # PEFT's process too, at its start
        from pockengine.backends.torch.heap import fix_heap_thresholds

        fix_heap_thresholds(*_THRESHOLDS)
    config, task = _task(args)
    idle, load_peak = vm_mib("VmRSS"), vm_mib("VmHWM")
    reset_peak()
    start = time.perf_counter()
    if case.scheme == "peft":
        model, train, trained = _peft_trainer(task, config, task.kind != "causal-lm")
    else:
        model, train, trained = _our_trainer(task, config, case, args)
    setup_s = time.perf_counter() - start
    setup_peak = vm_mib("VmHWM")  # compiling holds two copies of the weights a while
    reset_peak()
    peaks: list[float] = []
    times, losses = _train(train, task, config, args, peaks)
    train_peak = vm_mib("VmHWM")
    plan = {} if case.scheme == "peft" else _plan(model)
    if case.scheme != "peft":  # evaluate in torch
        model = _torch_model(model, task)
    row = {
        "case": args.child, "recipe": args.recipe, "steps": args.steps,
        "batch_size": config.batch_size, "seq_len": config.seq_len, "lr": config.lr,
        "remat_budget": args.remat_budget if case.remat else None,
        "trained_elements": int(trained),
        "step_s_median": statistics.median(times[1:] or times), "step_s_first": times[0],
        "setup_s": setup_s, "idle_rss_mib": idle, "train_peak_rss_mib": train_peak,
        "training_mib": train_peak - idle, "setup_peak_rss_mib": setup_peak,
        "training_mib_by_step": [round(m - idle, 1) for m in peaks],
        "process_peak_rss_mib": max(load_peak, setup_peak, train_peak),
        **plan,
        "first_loss": losses[0], "last_loss_mean10": float(np.mean(losses[-10:])),
        **_evaluate(model, task),
        "train_examples": task.train_size, "val_examples": task.val_size,
        "threads": args.threads, "dropout": args.dropout, "heap": args.heap,
        "workspace": args.workspace, "heap_thresholds": args.heap_thresholds,
        "thresholds_all": args.thresholds_all,
    }  # fmt: skip
    print(json.dumps(row))


_FORWARDED = ("recipe", "steps", "threads", "seed", "dropout", "lora_lr", "max_train",
              "max_val", "batch_size", "seq_len", "remat_budget", "heap", "workspace",
              "heap_thresholds")  # fmt: skip


def _run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case in its own process; an artifact case is compiled and saved by another
    process first, and the measured one only loads it."""
    argv = [__file__, "--child", case, *forward(args, _FORWARDED)]
    argv += ["--thresholds-all"] if args.thresholds_all else []
    try:
        if not Case.of(case).artifact:
            return run_child(argv, args.threads, cwd=ROOT)
        with tempfile.TemporaryDirectory(prefix="pe-lora-peer-") as tmp:
            folder = str(Path(tmp) / "step")
            run_child([*argv, "--prepare", folder], args.threads, cwd=ROOT)
            return run_child([*argv, "--artifact", folder], args.threads, cwd=ROOT)
    except ChildFailedError as e:
        print(f"{case} failed:\n{e.stderr[-3000:]}", file=sys.stderr)
        return {"case": case, "error": e.stderr[-1000:]}


def _table(rows: list[dict[str, Any]]) -> str:
    quality = "val_perplexity" if any("val_perplexity" in r for r in rows) else "val_accuracy"
    lines = [
        f"| case | trained elements | step (s, median) | idle RSS (MiB) | training (MiB) "
        f"| process peak (MiB) | planned peak (MiB) | {quality.replace('_', ' ')} | val loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: see the results JSON | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['trained_elements']:,} | {r['step_s_median']:.3f} "
            f"| {r['idle_rss_mib']:.0f} | {r['training_mib']:.0f} "
            f"| {r['process_peak_rss_mib']:.0f} | {r.get('planned_peak_mib', math.nan):.0f} "
            f"| {r[quality]:.3f} | {r['val_loss']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="minilm-bbc")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--steps", type=int, default=100)
    add_data_options(p, max_train=1600, max_val=200, shapes=("batch_size", "seq_len"))
    add_run_options(p, threads=1)
    p.add_argument("--dropout", choices=("model", "off"), default="model")
    p.add_argument("--lora-lr", type=float, help="peak lr of the LoRA cases (default: recipe's)")
    p.add_argument(
        "--remat-budget",
        default=REMAT_BUDGET,
        help=f"memory budget of the -remat cases (default {REMAT_BUDGET})",
    )
    p.add_argument(
        "--heap",
        choices=("default", "keep"),
        default="default",
        help="keep: every case's process keeps its freed heap (glibc thresholds fixed, "
        "backends.torch.keep_freed_heap) and the compiled steps run with keep_heap=True",
    )
    p.add_argument(
        "--workspace",
        choices=("off", "on"),
        default="off",
        help="on: the compiled steps write their large results into a workspace they keep "
        "between calls (TorchBackend(workspace=True)); PEFT's case is unaffected",
    )
    p.add_argument(
        "--heap-thresholds",
        metavar="MMAP,TRIM",
        help="our steps fix glibc's mmap and trim thresholds (bytes, K or M: 2M,8M; "
        "TorchBackend(heap_thresholds=...), process-wide; PEFT's case is unaffected)",
    )
    p.add_argument(
        "--thresholds-all", action="store_true", help="with --heap-thresholds: PEFT's too"
    )
    p.add_argument("--tag", help="suffix of the results file (a re-run beside the first)")
    p.add_argument("--prepare", help=argparse.SUPPRESS)  # child: compile, save the step here
    p.add_argument("--artifact", help=argparse.SUPPRESS)  # child: load the step from here
    args = p.parse_args()
    if args.thresholds_all and args.heap_thresholds is None:
        p.error("--thresholds-all needs --heap-thresholds")
    global _THRESHOLDS
    try:
        _THRESHOLDS = _thresholds(args.heap_thresholds)
    except ValueError:
        p.error(f"--heap-thresholds {args.heap_thresholds}: two sizes, as 2M,8M")
    if args.prepare:
        _prepare(args)
    elif args.child:
        _child(args)
    else:
        _main(args)


def _main(args: argparse.Namespace) -> None:
    rows = run_cases(args.cases, lambda case: _run_case(case, args))
    suffix = "-nodropout" if args.dropout == "off" else ""
    suffix += f"-lora-lr{args.lora_lr:g}" if args.lora_lr is not None else ""
    suffix += f"-remat{args.remat_budget}" if args.remat_budget != REMAT_BUDGET else ""
    suffix += "-keepheap" if args.heap == "keep" else ""
    suffix += "-workspace" if args.workspace == "on" else ""
    if args.heap_thresholds is not None:
        suffix += "-heap" + args.heap_thresholds.replace(",", "-")
        suffix += "-all" if args.thresholds_all else ""
    suffix += f"-{args.tag}" if args.tag else ""
    hidden = ("child", "prepare", "artifact", "tag")
    settings = {k: v for k, v in vars(args).items() if k not in hidden}
    write_results(f"lora_peer-{args.recipe}{suffix}", {"args": settings, "rows": rows})
    print(_table(rows))


if __name__ == "__main__":
    main()
