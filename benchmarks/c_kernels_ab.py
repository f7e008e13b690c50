"""The C backend's step with the kernels of a git revision against the working tree's.

    OMP_NUM_THREADS=1 python benchmarks/c_kernels_ab.py --rev HEAD --workload mbv2 \
        --scheme sparse --rounds 8
    OMP_NUM_THREADS=1 python benchmarks/c_kernels_ab.py --unfused --workload mbv2 --rounds 8
    OMP_WAIT_POLICY=passive python benchmarks/c_kernels_ab.py --threads 2 --rev main --rounds 8
    OMP_NUM_THREADS=1 python benchmarks/c_kernels_ab.py --unfused-pointwise --rounds 16 \
        [--worktree-first]

With ``--unfused`` the baseline is instead the working tree's kernels with the C backend's
batch-norm fusion (``backends/c/fuse_bn.py``) turned off, so the two steps differ by that
rewrite alone; with ``--unfused-pointwise`` only ``fuse_dw_bn.py``'s pointwise rewrite is
off. Both steps are compiled in this process (the revision's ``kernels/`` extracted with
``git show`` to a temporary folder), then stepped in turn, ``--rounds`` times each, on the
same batch. Prints the median and best CPU seconds a step (``time.process_time``: on a
shared machine it moves less than wall time) and whether every loss and every trained
value came out the same, bit for bit. One JSON object on the last line. The step's C code
is the working tree's for both: a revision whose kernels take other arguments than the
tree's lowering passes cannot be stepped against it (192f486 and earlier on MobileNetV2's
sparse step: their batch norm gradients need a ``gx``, which the tree leaves out where
nothing reads it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _harness import extract_kernels


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


@contextlib.contextmanager
def _without_pointwise_bn() -> Iterator[None]:
    """The C backend with ``fuse_dw_bn``'s pointwise rewrite off (no plane reaches its
    minimum)."""
    from pockengine.backends.c import fuse_dw_bn

    saved = fuse_dw_bn.PW_BN_MIN_PLANE
    fuse_dw_bn.PW_BN_MIN_PLANE = sys.maxsize
    try:
        yield
    finally:
        fuse_dw_bn.PW_BN_MIN_PLANE = saved


def _baseline(args: argparse.Namespace, worktree: Path, tmp: Path) -> tuple[Any, list[Any]]:
    """The step to compare against: the revision's kernels, or the working tree's with a
    rewrite off (``args.rev`` then names it)."""
    if args.unfused or args.unfused_pointwise:
        args.rev = "unfused" if args.unfused else "unfused-pointwise"
        with _without_bn_fusion() if args.unfused else _without_pointwise_bn():
            return _compile(args.workload, args.scheme, worktree, args.threads)
    extract_kernels(args.rev, tmp)
    return _compile(args.workload, args.scheme, tmp, args.threads)


def _parse() -> argparse.Namespace:
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
    parser.add_argument(
        "--unfused-pointwise", action="store_true",
        help="baseline: the tree without fuse_dw_bn's pointwise rewrite",
    )  # fmt: skip
    parser.add_argument(
        "--worktree-first", action="store_true",
        help="compile and step the working tree's first (the step compiled second can run "
        "a few percent slower in CPU time: run both orders)",
    )  # fmt: skip
    return parser.parse_args()


def main() -> int:
    args = _parse()
    from pockengine.backends.c import driver

    worktree = driver.KERNEL_DIR
    with tempfile.TemporaryDirectory(prefix="pe-kernels-") as tmp:
        if args.worktree_first:
            ours = _compile(args.workload, args.scheme, worktree, args.threads)
            base = _baseline(args, worktree, Path(tmp))
            steps = {"worktree": ours, args.rev: base}
        else:
            base = _baseline(args, worktree, Path(tmp))
            ours = _compile(args.workload, args.scheme, worktree, args.threads)
            steps = {args.rev: base, "worktree": ours}
        seconds: dict[str, list[float]] = {k: [] for k in steps}
        losses: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds + 1):  # the first round is a warm-up
            for tag, (step, batch) in steps.items():
                start = time.process_time()
                losses[tag].append(step(*batch))
                seconds[tag].append(time.process_time() - start)
    old, new = steps[args.rev][0], steps["worktree"][0]
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
