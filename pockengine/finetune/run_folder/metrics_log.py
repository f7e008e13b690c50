"""``metrics.jsonl``: a run's log of its training and validation metrics, one JSON object
a line."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.finetune.run_folder.checkpoint import write_json_lines
from pockengine.finetune.run_folder.run_files import read_metric_rows
from pockengine.safe_write import append_text

__all__ = ["MetricsLog"]


class MetricsLog:
    """``metrics.jsonl``: appended and flushed a line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, row: Mapping[str, Any]) -> None:
        """One line, appended and flushed (a link in its place is refused, not followed)."""
        append_text(self.path, json.dumps(_plain(row)) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """The complete lines (a line a killed run left half written is skipped)."""
        return read_metric_rows(self.path) if self.path.exists() else []

    def truncate_after(self, step: int) -> None:
        """Keep only the lines up to training step ``step`` (those a checkpoint covers)."""
        if self.path.exists():
            keep = [
                r
                for r in self.rows()
                if r.get("event") != "summary" and int(r.get("step", 0)) <= step
            ]
            write_json_lines(self.path, keep)


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in row.items()}
