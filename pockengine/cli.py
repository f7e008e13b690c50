"""The ``pockengine`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from pockengine.ir import PockEngineError

__all__ = ["main"]

log = logging.getLogger("pockengine")


def _demo(args: argparse.Namespace) -> int:
    import torch

    import pockengine as pe
    from pockengine import zoo

    torch.set_num_threads(args.threads)
    work = zoo.small_cnn(batch=16, size=16)
    batch = work.make_batch(0)
    start = time.perf_counter()
    step = pe.compile(
        work.model, work.loss_fn, batch, optimizer=pe.optim.SGD(lr=0.05, momentum=0.9)
    )
    n_nodes = len(step.graph.nodes)
    print(
        f"compiled {work.name}: {n_nodes} nodes in one training graph "
        f"({len(step.trained)} trained params) in {time.perf_counter() - start:.1f}s"
    )
    for i in range(args.steps):
        loss = step(*batch)
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {loss:.4f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pockengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small CNN and watch its loss fall")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--threads", type=int, default=2)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except PockEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
