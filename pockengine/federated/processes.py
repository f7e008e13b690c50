"""The processes a local deployment starts: finding them by process group, signalling
them, and turning SIGTERM into ``KeyboardInterrupt`` so they are stopped (Linux ``/proc``;
elsewhere the table is empty)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = ["live_members", "process_table", "signal_group", "terminate_raises"]


def live_members(groups: list[int]) -> list[int]:
    """The processes (not zombies) in these process groups."""
    wanted = set(groups)
    return [
        pid
        for pid, (_, group, state) in process_table().items()
        if group in wanted and state != "Z"
    ]


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process, from ``/proc``
    (Linux; empty elsewhere)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ")"
            fields = stat.read_text().rpartition(")")[2].split()
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` in here, so the processes are stopped."""
    if sys.platform == "win32" or not _is_main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
