"""The progress bar on stderr: loss, examples per second, ETA.

``tqdm`` draws it when installed; otherwise (or with ``progress="plain"``) a plain
line is written every few seconds, which also suits logs that are not terminals.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from typing import Any

__all__ = ["Progress", "make_progress"]


class Progress:
    """No output; the base of the two that write."""

    def __init__(self, total_steps: int, done_steps: int, batch_size: int) -> None:
        self.total = total_steps
        self.done = done_steps
        self.batch_size = batch_size
        self._start = time.perf_counter()
        self._start_done = done_steps

    def update(self, loss: float, lr: float, epoch: int) -> None:
        self.done += 1

    def message(self, text: str) -> None:
        """A line between bar updates (eval results, checkpoints)."""

    def close(self) -> None:
        pass

    # shared arithmetic
    def rate(self) -> float:
        """Examples per second since this bar started."""
        elapsed = time.perf_counter() - self._start
        return (self.done - self._start_done) * self.batch_size / elapsed if elapsed else 0.0

    def eta(self) -> str:
        rate = self.rate()
        if rate <= 0:
            return "?"
        seconds = int((self.total - self.done) * self.batch_size / rate)
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainProgress(Progress):
    """A line on stderr at most every ``every`` seconds (and at the last step)."""

    def __init__(
        self, total_steps: int, done_steps: int, batch_size: int, every: float = 5.0
    ) -> None:
        super().__init__(total_steps, done_steps, batch_size)
        self.every = every
        self._last = 0.0

    def update(self, loss: float, lr: float, epoch: int) -> None:
        super().update(loss, lr, epoch)
        now = time.perf_counter()
        if now - self._last >= self.every or self.done == self.total:
            self._last = now
            self.message(
                f"step {self.done}/{self.total}  epoch {epoch + 1}  loss {loss:.4f}  "
                f"lr {lr:.2e}  {self.rate():.1f} ex/s  ETA {self.eta()}"
            )

    def message(self, text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class TqdmProgress(Progress):
    """tqdm counting examples, so its rate is examples/s and its ETA is the run's."""

    def __init__(self, total_steps: int, done_steps: int, batch_size: int) -> None:
        super().__init__(total_steps, done_steps, batch_size)
        tqdm: Any = importlib.import_module("tqdm")
        self._bar = tqdm.tqdm(
            total=total_steps * batch_size,
            initial=done_steps * batch_size,
            unit="ex",
            file=sys.stderr,
            dynamic_ncols=True,
            desc="fine-tune",
        )

    def update(self, loss: float, lr: float, epoch: int) -> None:
        super().update(loss, lr, epoch)
        self._bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", lr=f"{lr:.1e}", refresh=False)
        self._bar.update(self.batch_size)

    def message(self, text: str) -> None:
        self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def make_progress(mode: str, total_steps: int, done_steps: int, batch_size: int) -> Progress:
    """``auto``: tqdm if installed, else plain; ``plain``; ``none``."""
    if mode == "none":
        return Progress(total_steps, done_steps, batch_size)
    if mode == "auto" and importlib.util.find_spec("tqdm") is not None:
        return TqdmProgress(total_steps, done_steps, batch_size)
    return PlainProgress(total_steps, done_steps, batch_size)
