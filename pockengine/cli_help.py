"""How every ``pockengine`` subcommand's ``--help`` reads.

``HelpFormatter`` is the formatter of the ``pockengine`` parser and so of every
subparser (argparse builds subparsers with the parent's class, and ``pockengine.cli``'s
parser class defaults to this formatter): each option's help ends with its default,
unless the text already says it, and choices show as ``{a,b}``. Descriptions and
epilogs keep their line breaks. Help text is plain: no markup characters.

``BACKEND_HELP``, ``RECIPE_HELP`` and ``THREADS_HELP`` are the texts the commands share,
so ``--backend``, ``--recipe`` and ``--threads`` read the same everywhere (their values
are checked when the run starts, by messages that list the valid names).
"""

from __future__ import annotations

import argparse
import copy
import textwrap

from pockengine.backends import BACKENDS
from pockengine.tasks.config import DEFAULT_RECIPE

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_HELP",
    "RECIPE_DATA",
    "RECIPE_HELP",
    "THREADS_HELP",
    "HelpFormatter",
]

# What ``--backend`` accepts: every registered backend, and torch-cpu (torch, kept on CPU).
BACKEND_CHOICES = (*BACKENDS, "torch-cpu")

# Each recipe and its data by default (tests check the names against recipes.RECIPES).
RECIPE_DATA = {
    "minilm-bbc": "BBC News topics, 5 classes: 1701 train / 426 validation articles",
    "minilm-tweets": "tweet sentiment, 3 classes: 4000 train / 1000 validation of 38158",
    "lite0-fashion": "Fashion-MNIST, 10 classes: 2000 train / 500 validation images",
    "smollm2-pydocs": "Python 3.11 docs, causal LM: 64 train / 32 validation chunks",
    "smollm2-pyqa": "Python-docs question/answer pairs: 192 train / 48 validation / 128 test",
    "generic": "your --model on your --data",
    "generic-lm": "your causal-LM --model on your text, instructions or chats",
}
RECIPE_HELP = (
    f"a built-in recipe (default {DEFAULT_RECIPE} unless --model or --data is given): "
    + "; ".join(f"{name}, {data}" for name, data in RECIPE_DATA.items())
)
THREADS_HELP = "torch threads (default: torch's own, one per core)"
BACKEND_HELP = f"what runs the compiled step: {', '.join(BACKEND_CHOICES)}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default at the end of its help, even an option given no help
    (``None`` defaults, which mean unset, and flags' on/off states are not shown); lines are
    not broken at hyphens (``bias-only``, ``minilm-bbc``); descriptions keep their line
    breaks."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)  # argparse prints no help line for an empty help
            action.help = _default_text(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return f"{text} {_default_text(action)}"

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _default_text(action: argparse.Action) -> str:
    """``(default: X)``, as a format string for ``argparse``'s ``%`` expansion."""
    if isinstance(action.default, list | tuple):
        shown = " ".join(str(v) for v in action.default).replace("%", "%%")
    else:
        shown = "%(default)s"
    return f"(default: {shown})"


def _shows_default(action: argparse.Action) -> bool:
    """An option whose default means something: not unset or suppressed, and not the
    on/off state of a flag (a flag's help says what giving it does)."""
    default = action.default
    flag = action.nargs == 0 and isinstance(default, bool)
    return bool(action.option_strings) and not (
        flag or default is None or default is argparse.SUPPRESS
    )
