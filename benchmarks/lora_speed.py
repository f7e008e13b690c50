"""PEFT's eager LoRA step against ours in one process, alternating step by step.

    OMP_NUM_THREADS=1 python benchmarks/lora_speed.py --seq-len 64 --max-train 320 \
        --max-val 128 --dropout off --rounds 22 --variants peft lora lora-ws

``lora_peer.py`` runs each case in its own process, which is what its memory column
needs; on a shared machine its step times swing more between processes than the
difference being measured. Here every variant lives in this one process and each round
runs one step of each, on the same batch, in an order that rotates from round to round,
so a load spike hits all variants alike. Variants: ``peft`` (``get_peft_model``, eager,
as in ``lora_peer.py``), ``lora`` (our ``--scheme lora``, compiled for the torch
backend), with suffixes ``-ws`` (``TorchBackend(workspace=True)``) and ``-remat``
(``memory_budget=--remat-budget``). Each variant trains its own copy of the model under
the recipe's warmup + linear-decay schedule. Reported: per variant the median step time
over the rounds after ``--warmup`` and its ratio to ``peft``'s, and the load average
before and after. ``--heap keep`` fixes glibc's thresholds for the whole process
(``keep_freed_heap``), so every variant runs under them; ``--heap-thresholds 2M,8M``
fixes glibc's mmap and trim thresholds (``backends.torch.heap.fix_heap_thresholds``) for every
variant alike. Writes benchmarks/results/lora_speed-<recipe>[-nodropout][-keepheap]
[-heap<mmap>-<trim>][-<tag>].json. Memory is
not measured here: one process holds every variant (``lora_peer.py`` measures memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import lora_peer
from _harness import add_data_options, add_run_options, utc_now, write_results

VARIANTS = ("peft", "lora", "lora-ws", "lora-remat", "lora-remat-ws")


def _trainer(variant: str, args: argparse.Namespace) -> Callable[..., float]:
    """A fresh model and data for ``variant``, and its train function ``(lr, *batch)``."""
    import torch

    from pockengine.step.compiler import release_free_memory

    peft = variant == "peft"
    case = lora_peer.Case.of("peft" if peft else "lora-remat" if "remat" in variant else "lora")
    task_args = argparse.Namespace(**{**vars(args), "child": case.scheme})
    config, task = lora_peer._task(task_args)
    if peft:
        _, train, _ = lora_peer._peft_trainer(task, config, task.kind != "causal-lm")
        return train
    workspace = "on" if variant.endswith("-ws") else "off"
    step = lora_peer._compile(task, config, case, args.remat_budget, args.heap, workspace)
    for p in task.model.parameters():  # the step holds its own weights
        p.data = torch.empty(0)
    release_free_memory()

    def train(lr: float, *batch: Any) -> float:
        step.lr = lr
        return float(step(*batch))

    return train


def _rounds(
    trainers: dict[str, Callable[..., float]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """``args.rounds`` rounds of one step per variant on the same batch, the variants'
    order rotated each round; the step times per variant."""
    from pockengine.optim import linear_schedule
    from pockengine.tasks import recipes
    from pockengine.tasks.config import FinetuneConfig

    config = FinetuneConfig(recipe=args.recipe, max_train=args.max_train, max_val=args.max_val,
                            batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                            scheme="lora")  # fmt: skip
    config = config.with_defaults(recipes.defaults(config)).validate()
    train = recipes.build(config).train
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    warmup = round(config.warmup * args.rounds)
    batches = lora_peer._batches(train, config.batch_size, args.rounds, args.seed)
    for r, batch in enumerate(batches):
        lr = linear_schedule(r, float(config.lr), warmup, args.rounds)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            tick = time.perf_counter()
            trainers[name](lr, *batch)
            times[name].append(time.perf_counter() - tick)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="minilm-bbc")
    p.add_argument("--variants", nargs="+", default=["peft", "lora", "lora-ws"], choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=22)
    p.add_argument("--warmup", type=int, default=2, help="rounds left out of the medians")
    add_data_options(p, max_train=320, max_val=128, shapes=("batch_size", "seq_len"))
    add_run_options(p, threads=1, child=False)
    p.add_argument("--dropout", choices=("model", "off"), default="off")
    p.add_argument("--lora-lr", type=float, help="peak lr of the LoRA cases (default: recipe's)")
    p.add_argument("--remat-budget", default="185MB", help="memory budget of -remat variants")
    p.add_argument("--heap", choices=("default", "keep"), default="default")
    p.add_argument("--heap-thresholds", metavar="MMAP,TRIM", help="glibc's, process-wide")
    p.add_argument("--tag", help="suffix of the results file")
    args = p.parse_args()
    if args.rounds <= args.warmup:
        p.error(f"--rounds ({args.rounds}) must exceed --warmup ({args.warmup})")
    _run(args)


def _run(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.heap == "keep":
        from pockengine.backends.torch.backend import keep_freed_heap

        keep_freed_heap()
    thresholds = lora_peer._thresholds(args.heap_thresholds)
    if thresholds is not None:
        from pockengine.backends.torch.heap import fix_heap_thresholds

        fix_heap_thresholds(*thresholds)
    trainers = {v: _trainer(v, args) for v in dict.fromkeys(args.variants)}
    load_before, start = os.getloadavg(), utc_now()
    times = _rounds(trainers, args)
    medians = {v: statistics.median(t[args.warmup :]) for v, t in times.items()}
    peft = medians.get("peft")
    rows = [
        {"variant": v, "step_s_median": m, "vs_peft": None if peft is None else m / peft,
         "step_s": times[v]}
        for v, m in medians.items()
    ]  # fmt: skip
    suffix = "-nodropout" if args.dropout == "off" else ""
    suffix += "-keepheap" if args.heap == "keep" else ""
    suffix += f"-heap{args.heap_thresholds.replace(',', '-')}" if args.heap_thresholds else ""
    suffix += f"-{args.tag}" if args.tag else ""
    write_results(f"lora_speed-{args.recipe}{suffix}", {
        "args": vars(args), "started": start, "finished": utc_now(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": rows,
    })  # fmt: skip
    for row in rows:
        ratio = "" if row["vs_peft"] is None else f"  {row['vs_peft']:.3f}x peft"
        print(f"{row['variant']:>14}: {row['step_s_median']:.3f} s{ratio}")
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
