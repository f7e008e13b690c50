"""The ``pockengine`` command line: demo, inspect, finetune, search, export."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from pockengine.ir import PockEngineError

__all__ = ["main"]

log = logging.getLogger("pockengine")


def _scheme(spec: str | None, workload: str) -> Any:
    """A scheme from a file (.json/.yaml) or a name: full, bias, sparse, head, last:K."""
    from pathlib import Path

    from pockengine import schemes, zoo

    if spec is None:
        return None
    if Path(spec).suffix in (".json", ".yaml", ".yml"):
        return schemes.load(spec)
    if spec.startswith("last:"):
        return schemes.last_blocks(int(spec.split(":", 1)[1]))
    named = zoo.benchmark_schemes(workload)
    if spec not in named:
        raise PockEngineError(f"unknown scheme {spec!r}: a file, last:K, or one of {list(named)}")
    return named[spec]


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
        work.model, work.loss_fn, work.make_batch(0), optimizer=optimizer,
        scheme=_scheme(args.scheme, args.workload),
    )  # fmt: skip
    report = step.report(depth=args.depth)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    if args.graph:
        print(step.graph)
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from pockengine.finetune import finetune
    from pockengine.finetune.cli import config_from_args, exit_code

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = finetune(config_from_args(args))
    print(result.summary())
    return exit_code(result.stopped)


def _search(args: argparse.Namespace) -> int:
    from pockengine.finetune.cli import config_from_args
    from pockengine.finetune.scheme_search import parse_amount, search_scheme
    from pockengine.finetune.sensitivity import AnalysisSettings

    mem, flops = args.memory_budget, args.flops_budget
    result = search_scheme(
        config_from_args(args),
        parse_amount(mem) if mem else None,
        parse_amount(flops, flops=True) if flops else None,
        settings=AnalysisSettings(
            steps=args.steps, holdout=args.holdout, lr=args.analysis_lr, threads=args.threads
        ),
        layers=args.layers, ratios=args.ratios, workers=args.workers, cache_dir=args.cache_dir,
        out=args.out, plot=args.plot or f"{args.out}.png",
        progress=args.progress != "none",
    )  # fmt: skip
    print(json.dumps(result.to_dict(), indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    """Compile a zoo workload or an .onnx model and write its training step for ort_runner."""
    import pockengine as pe

    if args.model.endswith(".onnx"):
        from pockengine import schemes

        named = {
            "full": schemes.full,
            "bias": schemes.bias_only,
            "head": schemes.head,
            "sparse": lambda: schemes.sparse(blocks=1),
        }
        spec = args.scheme
        scheme = named[spec]() if spec in named else _scheme(spec, "") if spec else None
        optimizer = (
            pe.optim.AdamW(lr=args.lr or 1e-3)
            if args.optimizer == "adamw"
            else pe.optim.SGD(lr=args.lr or 0.01, momentum=0.9)
        )
        output = int(args.output) if args.output and args.output.isdigit() else args.output
        step = pe.compile(
            args.model, loss=args.loss, output=output, optimizer=optimizer, scheme=scheme
        )
    else:
        from pockengine import zoo

        work, optimizer = zoo.benchmark(args.model)
        step = pe.compile(
            work.model,
            work.loss_fn,
            work.make_batch(0),
            optimizer=optimizer,
            scheme=_scheme(args.scheme, args.model),
        )
    side = step.export(args.out)
    print(
        f"wrote {args.out} and {side} ({len(step.graph.nodes)} nodes, "
        f"{len(step.trained)} trained params); run it with pockengine/ort_runner.py"
    )
    return 0


def _add_export(sub: Any) -> None:
    export = sub.add_parser("export", help="write a training step as ONNX + state for ort_runner")
    export.add_argument("model", help="a workload (mlp, cnn, bert, ...) or a model.onnx")
    export.add_argument("-o", "--out", default="train_step.onnx", help="the .onnx to write")
    export.add_argument("--scheme", help="full, bias, sparse, head, last:K or a scheme file")
    export.add_argument(
        "--loss",
        default="cross_entropy",
        help="for an .onnx model: cross_entropy, mse, causal_lm or none",
    )
    export.add_argument("--output", help="for an .onnx model: the output the loss applies to")
    export.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default="sgd",
        help="for an .onnx model (workloads use their benchmark optimizer)",
    )
    export.add_argument("--lr", type=float, help="learning rate (for an .onnx model)")
    export.set_defaults(run=_export)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pockengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small CNN and watch its loss fall")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--threads", type=int, default=2)
    demo.set_defaults(run=_demo)
    inspect = sub.add_parser("inspect", help="the compile-time report of a workload and scheme")
    inspect.add_argument("workload", help="mbv2, bert, llama, mlp, cnn, mbv2-small")
    inspect.add_argument("--scheme", help="full, bias, sparse, head, last:K or a scheme file")
    inspect.add_argument("--depth", type=int, default=2, help="module path depth of the table")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--graph", action="store_true", help="also print the training graph")
    inspect.set_defaults(run=_inspect)
    from pockengine.finetune.cli import EPILOG, add_arguments

    finetune = sub.add_parser(
        "finetune", help="fine-tune a recipe or your model on your data, with checkpoints",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(finetune)
    finetune.set_defaults(run=_finetune)
    from pockengine.finetune.cli import add_search_arguments

    search = sub.add_parser(
        "search", help="contribution analysis, then the best scheme under a memory/FLOPs budget",
        conflict_handler="resolve",
    )  # fmt: skip
    add_search_arguments(search)
    search.set_defaults(run=_search)
    _add_export(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except (PockEngineError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
