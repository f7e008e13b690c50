"""The C backend's step with the kernels of a git revision against the working tree's.

    OMP_NUM_THREADS=1 python benchmarks/c_kernels_ab.py --rev HEAD --workload mbv2 \
        --scheme sparse --rounds 8
    OMP_NUM_THREADS=1 python benchmarks/c_kernels_ab.py --unfused --workload mbv2 --rounds 8
    OMP_WAIT_POLICY=passive python benchmarks/c_kernels_ab.py --threads 2 --rev main --rounds 8

With ``--unfused`` the baseline is instead the working tree's kernels with the C backend's
batch-norm fusion (``backends/c/fuse_bn.py``) turned off, so the two steps differ by that
rewrite alone. Both steps are compiled in this process (the revision's ``kernels/`` extracted with
``git show`` to a temporary folder), then stepped in turn, ``--rounds`` times each, on the
same batch. Prints the median and best CPU seconds a step (``time.process_time``: on a
shared machine it moves less than wall time) and whether every loss and every trained
value came out the same, bit for bit. One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _harness import ROOT

KERNELS = "pockengine/backends/c/kernels"


def _extract(rev: str, folder: Path) -> None:
    """The revision's kernel files into ``folder``."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    for name in names:
        data = subprocess.run(["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=ROOT,
                              capture_output=True, check=True).stdout  # fmt: skip
        (folder / name).write_bytes(data)


def _compile(workload: str, scheme_name: str, kernels: Path, threads: int) -> tuple[Any, list[Any]]:
    import pockengine as pe
    from pockengine import zoo
    from pockengine.backends.c import CBackend, driver

    driver.KERNEL_DIR = kernels  # read by kernel_sources() and the -I flag when building
    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    backend = CBackend(threads=threads)
    return pe.compile(work.model, work.loss_fn, batch, optimizer, scheme, backend=backend), batch


@contextlib.contextmanager
def _without_bn_fusion() -> Iterator[None]:
    """The C backend with its batch-norm rewrite replaced by the identity."""
    from pockengine.backends.c import backend, lowering
    from pockengine.backends.c.fuse_bn import fuse_batch_norm_hardtanh

    saved = lowering.LOWERING_PASSES, backend.CBackend.lowering_passes
    unfused = tuple(p for p in saved[0] if p is not fuse_batch_norm_hardtanh)
    lowering.LOWERING_PASSES = unfused  # what CExecutable runs
    backend.CBackend.lowering_passes = lambda self: unfused  # type: ignore[method-assign]
    try:
        yield
    finally:
        lowering.LOWERING_PASSES, backend.CBackend.lowering_passes = saved


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--workload", default="mbv2")
    parser.add_argument("--scheme", default="sparse")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="CBackend(threads=...)")
    parser.add_argument(
        "--unfused", action="store_true", help="baseline: the tree without batch-norm fusion"
    )
    args = parser.parse_args()
    from pockengine.backends.c import driver

    worktree = driver.KERNEL_DIR
    with tempfile.TemporaryDirectory(prefix="pe-kernels-") as tmp:
        if args.unfused:
            args.rev = "unfused"
            with _without_bn_fusion():
                base = _compile(args.workload, args.scheme, worktree, args.threads)
        else:
            _extract(args.rev, Path(tmp))
            base = _compile(args.workload, args.scheme, Path(tmp), args.threads)
        steps = {
            args.rev: base,
            "worktree": _compile(args.workload, args.scheme, worktree, args.threads),
        }
        seconds: dict[str, list[float]] = {k: [] for k in steps}
        losses: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds + 1):  # the first round is a warm-up
            for tag, (step, batch) in steps.items():
                start = time.process_time()
                losses[tag].append(step(*batch))
                seconds[tag].append(time.process_time() - start)
    (old, _), (new, _) = steps.values()
    same_state = all(np.array_equal(v, new.state_dict()[k]) for k, v in old.state_dict().items())
    row = {"workload": args.workload, "scheme": args.scheme, "rev": args.rev,
           "threads": args.threads,
           "median_s": {k: statistics.median(v[1:]) for k, v in seconds.items()},
           "best_s": {k: min(v[1:]) for k, v in seconds.items()},
           "bit_identical": same_state and losses[args.rev] == losses["worktree"]}  # fmt: skip
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
