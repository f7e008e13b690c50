"""MkDocs hooks: the command-line reference is generated from the argparse parsers at build
time, so ``docs/cli.md`` cannot drift from ``pockengine --help``."""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-reference -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Every ``pockengine`` command's ``--help``, one section each, as Markdown."""
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    from pockengine.cli import build_parser

    parser = build_parser()
    parts = ["## pockengine", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subparsers(parser).items():
        parts += [f"## pockengine {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
