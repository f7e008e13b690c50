"""Where the smollm2-pydocs sparse GGUF run's memory goes: by phase, and in the step's plan.

    python benchmarks/smollm2_memory.py [--optimizer-state int8] [--remat-budget 450MB]

One process, as ``pockengine finetune --recipe smollm2-pydocs --scheme sparse
--frozen-dtype gguf`` builds it: imports, the recipe's model, tokenizer and data (8
training chunks), the compiled step (torch backend, AdamW at the recipe's 5e-4 with the
given state dtype, the given recomputation budget; default: the recipe's 700 MB), then
two training steps. Prints RSS / peak RSS (MiB) after each phase, then the plan: the
persistent store by kind (frozen weights by dtype, trained weights, optimizer state)
and what the arena holds at its peak (saved activations, dequantized weights, weight
gradients, other temporaries), and the most gradient bytes alive at once.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from _harness import vm_kib

from pockengine.finetune.run_folder.released import release_held
from pockengine.ir import Graph, Phase, Value
from pockengine.optim import AdamW
from pockengine.passes.remat_budget import parse_budget
from pockengine.plan.memory import MemoryPlan, plan_memory
from pockengine.step.compiler import TrainStep, compile, release_free_memory
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.gguf import frozen_weights

MIB = 1 << 20


def mem(label: str) -> None:
    rss, peak = vm_kib("VmRSS") // 1024, vm_kib("VmHWM") // 1024
    print(f"{time.strftime('%H:%M:%S')} {label}: RSS {rss} MiB, peak {peak} MiB", flush=True)


def _kind(graph: Graph, value: Value, grads: set[str], producer: dict[str, int]) -> str:
    """What a value alive in the arena is."""
    if value.name in grads:
        return "weight gradients"
    i = producer.get(value.name)
    if i is None:
        return "batch"
    node = graph.nodes[i]
    if node.op == "dequantize" or (
        node.op == "transpose"
        and graph.nodes[producer.get(node.inputs[0].name, i)].op == "dequantize"
    ):
        return "dequantized weights"
    return "saved activations" if node.phase is Phase.FORWARD else "backward temporaries"


def breakdown(step: TrainStep) -> None:
    graph = step.graph
    plan: MemoryPlan = plan_memory(graph)
    figures = step.report().ours
    print(f"plan: {plan}")
    for dtype, n in figures.frozen_bytes.items():
        print(f"  frozen weights {dtype}: {n / MIB:.1f} MiB")
    print(f"  trained weights f32: {plan.trained_param_bytes / MIB:.1f} MiB")
    print(f"  optimizer state: {plan.state_bytes / MIB:.1f} MiB")
    print(f"  gradients: {figures.gradient_bytes / MIB:.1f} MiB in all, "
          f"{figures.gradient_live_bytes / MIB:.1f} MiB alive at once")  # fmt: skip
    grads = {n.inputs[1].name for n in graph.nodes if n.op.endswith("_update")}
    producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    at = plan.liveness.peak_index
    kinds: Counter[str] = Counter()
    for v in plan.liveness.live_at(at):
        kinds[_kind(graph, v, grads, producer)] += v.type.nbytes
    where = graph.nodes[at].op if 0 <= at < len(graph.nodes) else "entry/exit"
    print(f"  arena {plan.arena_bytes / MIB:.1f} MiB, live peak at node {at} ({where}):")
    for kind, n in kinds.most_common():
        print(f"    {kind}: {n / MIB:.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer-state", choices=("float32", "int8"), default="float32")
    p.add_argument("--remat-budget", default="700MB")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    mem("start (imports)")
    config = FinetuneConfig(recipe="smollm2-pydocs", scheme="sparse", frozen_dtype="gguf",
                            max_train=8, max_val=8, epochs=1)  # fmt: skip
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    mem("model + tokenizer + data")
    frozen = frozen_weights(config)
    example = tuple(torch.from_numpy(a[: config.batch_size]) for a in task.train)
    task.model.train()
    optimizer = AdamW(lr=5e-4, state_dtype=args.optimizer_state)
    scheme = recipes.parse_scheme("sparse", config.recipe)
    budget = parse_budget(args.remat_budget)
    step = compile(task.model, task.loss_fn, example, optimizer=optimizer, scheme=scheme,
                   backend="torch", frozen_dtype=frozen.dtype, quantized=frozen.given,
                   memory_budget=budget)  # fmt: skip
    mem("compiled")
    # as the trainer does once the evaluator is compiled: the model's float copies of what
    # the step holds are released
    release_held(task.model, step, also=step.trained)
    release_free_memory()
    mem("the model's float copies of what the step holds released")
    for i in range(2):
        t = time.perf_counter()
        loss = step(*(a[: config.batch_size] for a in task.train))
        mem(f"training step {i + 1} (loss {loss:.4f}, {time.perf_counter() - t:.1f} s)")
    breakdown(step)


if __name__ == "__main__":
    main()
