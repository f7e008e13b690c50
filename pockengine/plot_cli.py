"""``pockengine plot RUN [RUN...] [--out FILE.png]``: the curves of fine-tuning runs.

One run: its training loss (smoothed, the logged values faint) and validation metric
against step, the picture a run writes to ``RUN/curves.png`` as it goes. Several runs
(say sparse, full and head on one task): the same axes, one colour a run, with a legend
of each run's scheme, trained parameters and peak memory (``pockengine.finetune.running.curves``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register"]

_DESCRIPTION = """\
Draw the training loss and the validation metric of one or more pockengine finetune run
folders against step, in one PNG. Each run is a line with its scheme, trained parameters
and peak memory (whole-process peak RSS and the step's planned peak) in the legend.
Needs matplotlib (installed with pockengine)."""


def register(sub: Any) -> None:
    """Add ``plot`` to the ``pockengine`` subcommands."""
    p = sub.add_parser(
        "plot",
        help="the training curves of one or more fine-tuning runs, overlaid in a PNG",
        description=_DESCRIPTION,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a pockengine finetune run folder")
    p.add_argument(
        "--out",
        help="the PNG to write (default: RUN/curves.png for one run, curves.png here for several)",
    )
    p.set_defaults(run=_plot)


def _plot(args: argparse.Namespace) -> int:
    from pockengine.finetune.running.curves import CURVES, plot_runs

    runs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else (runs[0] / CURVES if len(runs) == 1 else Path(CURVES))
    print(plot_runs(runs, out))
    return 0
