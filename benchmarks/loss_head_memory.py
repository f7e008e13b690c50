"""SmolLM2's loss head alone, with and without the fused vocabulary loss.

    python benchmarks/loss_head_memory.py              # frozen and trained head, both ways

h [4, 128, 576] -> LayerNorm -> Linear(576, 49152, no bias) -> cross-entropy, AdamW, torch
backend: the compile-time planned peak, the whole-process peak RSS (VmHWM, compile
included) and the fastest of 5 steps, each variant in its own process. ``unfused`` drops
``fuse_linear_cross_entropy`` from the forward pipeline.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _harness import run_child, vm_mib

VOCAB, WIDTH, BATCH, SEQ = 49152, 576, 4, 128


def _child(variant: str, trained: bool, threads: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import pockengine as pe
    import pockengine.step.parts
    from pockengine.passes import FORWARD_PIPELINE, fuse_linear_cross_entropy

    if variant == "unfused":
        passes = tuple(p for p in FORWARD_PIPELINE if p is not fuse_linear_cross_entropy)
        setattr(pockengine.step.parts, "forward_passes", lambda supported: passes)  # noqa: B010
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False))
    model[1].weight.requires_grad_(trained)
    h, y = torch.randn(BATCH, SEQ, WIDTH), torch.randint(0, VOCAB, (BATCH, SEQ))

    def loss(m: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(h).reshape(-1, VOCAB), y.reshape(-1))

    step = pe.compile(model, loss, (h, y), optimizer=pe.optim.AdamW(lr=1e-4), backend="torch")
    times = []
    for _ in range(6):
        start = time.perf_counter()
        step(h, y)
        times.append(time.perf_counter() - start)
    return {
        "variant": variant,
        "head": "trained" if trained else "frozen",
        "fused": any(n.op == "linear_log_softmax_gather" for n in step.graph.nodes),
        "planned_peak_mib": step.report().ours.planned_peak_bytes / 2**20,
        "peak_rss_mib": vm_mib("VmHWM"),
        "step_s": min(times[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1] == "trained", args.threads)))
        return
    for head in ("frozen", "trained"):
        for variant in ("unfused", "fused"):
            row = run_child([__file__, "--threads", args.threads, "--child", variant, head])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
