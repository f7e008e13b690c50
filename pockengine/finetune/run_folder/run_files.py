"""The files of a run folder, read and checked by kind: one reader for each.

``summary.json`` (``read_summary``) and ``metrics.jsonl`` (``read_metric_rows``) are read
here; ``RUN/model/pockengine.json`` in ``run_meta``. A file that cannot be read, is not
what pockengine writes there, or holds a value of the wrong type is a ``RunFileError``
naming the file (and the line, for a JSON-lines file) and the entry, never a traceback
from deep inside the code that would have used the value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pockengine.tasks.config import FinetuneError
from pockengine.tasks.model_files import read_json

__all__ = ["RunFileError", "read_json_object", "read_metric_rows", "read_summary", "shown"]

# Entries of summary.json that are read back (the plot's legend), and their kind.
_SUMMARY_INTS = ("trained_params", "peak_rss_bytes", "planned_peak_bytes", "steps")


class RunFileError(FinetuneError):
    """A file of a run folder that is missing, unreadable or not what pockengine writes;
    the message names the file and what is wrong in it."""


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json_object(path: Path, what: str = "JSON file") -> dict[str, Any]:
    """The JSON object in ``path``; a ``RunFileError`` naming it otherwise."""
    return read_json(path, what, RunFileError)


def read_summary(path: Path) -> dict[str, Any]:
    """A run's ``summary.json``: an object whose read-back entries have their types."""
    summary = read_json_object(path, "run summary")
    config = summary.get("config", {})
    if not isinstance(config, dict):
        raise RunFileError(f"{path}: 'config' is {shown(config)}; expected a JSON object")
    for name in _SUMMARY_INTS:
        value = summary.get(name, 0)
        if not _count(value):
            raise RunFileError(
                f"{path}: {name!r} is {shown(value)}; expected a non-negative integer"
            )
    return summary


def read_metric_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``: each complete line a JSON object (a line a
    killed run left half written is skipped), its ``step`` a non-negative integer and its
    losses, rates and validation metrics numbers."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path} is not a readable metrics file: {exc}") from exc
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            _check_row(row, path, number)
            rows.append(row)
    return rows


def _check_row(row: Mapping[str, Any], path: Path, line: int) -> None:
    if "step" in row and not _count(row["step"]):
        raise RunFileError(
            f"{path}:{line}: 'step' is {shown(row['step'])}; expected a non-negative integer"
        )
    for key, value in row.items():
        numeric = key in ("loss", "lr") or key.startswith("val_")
        if numeric and not _number(value):
            raise RunFileError(f"{path}:{line}: {key!r} is {shown(value)}; expected a number")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    """A number (a non-finite loss is logged as one) or null."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))
