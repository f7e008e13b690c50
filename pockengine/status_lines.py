"""What a fine-tune is doing before its first step, one line each on stderr.

Before the progress bar starts a run builds its task, may analyse the model
(``--scheme auto``) and compiles its step, often in a child process: up to a couple of
minutes on a small language model, which without these lines print nothing at all.
Each line says what starts (or what finished) and the seconds since the run started:

    [  2.6 s] model and data ready: 2,000 training examples
    [  7.0 s] --scheme auto: scoring 49 weights on 32 training examples: 2 group(s), 64
              backward passes
    [ 10.4 s] --scheme auto: 1 of 2 groups scored
    [ 12.4 s] --scheme auto: bias + 11 of 49 weights chosen in 9.6 s
    [ 13.0 s] compiling the training step (torch backend)

``configure(progress, started)`` turns them on (``--progress`` auto or plain) or off
(none); the compile child configures itself from the job its parent wrote, with the
parent's start time, so both processes count from the same moment. This module imports
nothing heavy: the parent of a compile child holds no torch.
"""

from __future__ import annotations

import sys
import time

__all__ = ["configure", "say", "started"]

_state: dict[str, float | bool] = {"on": False, "started": time.time()}


def configure(progress: str | None, started: float | None = None) -> None:
    """Lines on unless ``progress`` is ``"none"``; seconds count from ``started`` (a
    ``time.time()``; default: now)."""
    _state["on"] = progress != "none"
    _state["started"] = time.time() if started is None else started


def started() -> float:
    """The ``time.time()`` the lines count from (for a child's job)."""
    return float(_state["started"])


def say(text: str) -> None:
    """One line on stderr, when on."""
    if not _state["on"]:
        return
    sys.stderr.write(f"[{time.time() - float(_state['started']):5.1f} s] {text}\n")
    sys.stderr.flush()
