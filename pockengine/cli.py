"""The ``pockengine`` command line: demo, inspect, finetune, search, export."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from pockengine.cli_help import HelpFormatter
from pockengine.ir import PockEngineError
from pockengine.sparse.schemes import SCHEME_HELP

__all__ = ["build_parser", "main"]

log = logging.getLogger("pockengine")

_DESCRIPTION = """\
PockEngine compiles a whole training step (forward, backward, optimizer) into one static
graph and runs it. Each command has its own --help."""


class _UsageError(Exception):
    """A command line that does not parse (an unknown option, a value out of range)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one ``error:`` line (``main`` prints it), not a
    usage dump and a ``SystemExit`` from inside the parser; help shows every default
    (``HelpFormatter``, which subparsers inherit, being built with this class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message}")


def _scheme(spec: str | None, workload: str, frozen_bn: str = "eval") -> Any:
    """The scheme a name or file stands for (``pockengine.sparse.schemes``); ``sparse`` is
    the benchmark workload's own recipe."""
    from pockengine import zoo
    from pockengine.sparse.schemes import scheme_named

    if spec is None:
        return None
    return scheme_named(spec, sparse=zoo.workload_sparse(workload), frozen_bn=frozen_bn)


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


def _inspect(args: argparse.Namespace) -> int:
    import pockengine as pe
    from pockengine import zoo

    work, optimizer = zoo.benchmark(args.workload)
    step = pe.compile(
        work.model,
        work.loss_fn,
        work.make_batch(0),
        optimizer=optimizer,
        scheme=_scheme(args.scheme, args.workload, args.frozen_bn),
    )
    report = step.report(depth=args.depth)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    if args.graph:
        print(step.graph)
    return 0


def _set_threads(threads: int) -> None:
    """torch's thread count, without importing torch (the run imports it once its compile
    child is done: the environment reaches both); set directly where it is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def _finetune(args: argparse.Namespace) -> int:
    from pockengine.finetune import finetune
    from pockengine.finetune.cli import config_from_args, exit_code

    if args.threads:
        _set_threads(args.threads)
    result = finetune(config_from_args(args))
    if args.report:
        print(result.report, end="\n\n")
    print(result.summary())
    return exit_code(result.stopped)


def _search(args: argparse.Namespace) -> int:
    from pockengine.finetune.cli import config_from_args
    from pockengine.scheme_choice.scheme_search import parse_amount, search_scheme
    from pockengine.scheme_choice.sensitivity import AnalysisSettings

    mem, flops = args.memory_budget, args.flops_budget
    result = search_scheme(
        config_from_args(args),
        mem,  # bytes: finetune.cli.byte_amount
        parse_amount(flops, flops=True) if flops else None,
        settings=AnalysisSettings(
            steps=args.steps, holdout=args.holdout, lr=args.analysis_lr, threads=args.threads
        ),
        layers=args.layers,
        ratios=args.ratios,
        workers=args.workers,
        cache_dir=args.cache_dir,
        out=args.out,
        plot=args.plot or f"{args.out}.png",
        progress=args.progress != "none",
    )
    print(json.dumps(result.to_dict(), indent=2))
    return 0


def _add_frozen_bn(parser: Any) -> None:
    parser.add_argument(
        "--frozen-bn",
        choices=("eval", "train"),
        default="eval",
        help="BatchNorm layers that train nothing under a named scheme: running statistics "
        "(eval, as finetune runs them) or batch statistics (train, the benchmark tables)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(f"error: {exc} (see --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return _run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``pockengine`` parser, every subcommand registered."""
    from pockengine.finetune.cli import positive_int

    parser = _Parser(prog="pockengine", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small CNN and watch its loss fall")
    demo.add_argument("--steps", type=positive_int, default=30, help="training steps")
    demo.add_argument("--threads", type=positive_int, default=2, help="torch threads")
    demo.set_defaults(run=_demo)
    inspect = sub.add_parser("inspect", help="the compile-time report of a workload and scheme")
    inspect.add_argument("workload", help="mbv2, bert, llama, mlp, cnn, mbv2-small")
    inspect.add_argument(
        "--scheme", help=f"{SCHEME_HELP} (default: the parameters whose requires_grad is set)"
    )
    _add_frozen_bn(inspect)
    inspect.add_argument("--depth", type=int, default=2, help="module path depth of the table")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--graph", action="store_true", help="also print the training graph")
    inspect.set_defaults(run=_inspect)
    from pockengine.finetune.cli import EPILOG, add_arguments

    finetune = sub.add_parser(
        "finetune",
        help="fine-tune a recipe or your model on your data, with checkpoints",
        epilog=EPILOG,
    )
    add_arguments(finetune)
    finetune.add_argument(
        "--report", action="store_true", help="also print the compile-time report (RUN/report.txt)"
    )
    finetune.set_defaults(run=_finetune)
    from pockengine.finetune.cli import add_search_arguments

    search = sub.add_parser(
        "search",
        help="contribution analysis, then the best scheme under a memory/FLOPs budget",
        conflict_handler="resolve",
    )
    add_search_arguments(search)
    search.set_defaults(run=_search)
    from pockengine.run_cli import register as add_run_commands

    add_run_commands(sub)
    from pockengine.export_cli import register as add_export

    add_export(sub)
    from pockengine.federated.cli import register as add_federated

    add_federated(sub)
    from pockengine.plot_cli import register as add_plot

    add_plot(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    """Run a command; every failure is one ``error:`` line and exit 2, never a traceback
    (``PE_DEBUG=1`` shows the traceback of an unexpected one)."""
    import os

    try:
        return int(args.run(args))
    except (PockEngineError, KeyError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get("PE_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc} (PE_DEBUG=1 shows where)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
