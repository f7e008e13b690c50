"""One output folder, one run: a lock file naming the pid of the run that holds it.

Two runs writing one ``--out`` would interleave checkpoints and metrics. ``RunLock``
checks the folder before any work starts (a folder, creatable, writable, and new, empty
or a fine-tune run: ``pockengine.out_folder``, whose marker it writes once the lock is
taken; ``--force`` takes any folder), then creates ``.pockengine.lock`` holding its pid
with ``O_EXCL``. A lock whose pid is alive refuses
the second run; one left by a run that was killed (its pid is gone) is taken over with a
message. On exit the lock is removed, and a folder the run created but left empty (it
failed before writing anything) is removed too, so a refused run leaves no trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from types import TracebackType

from pockengine.finetune.run_folder.checkpoint import CHECKPOINT, saved_options
from pockengine.out_folder import RUN, OutFolder, claim, mark_folder, release
from pockengine.tasks.config import FinetuneError

__all__ = ["LOCK", "RUN_FILES", "RunLock", "check_out_folder"]

log = logging.getLogger(__name__)
LOCK = ".pockengine.lock"
# What a run writes at the top of its folder (result._FILES, and pockengine evaluate's).
RUN_FILES = frozenset(
    {
        "model",
        "adapter",
        CHECKPOINT,
        "best.safetensors",
        "metrics.jsonl",
        "summary.json",
        "report.txt",
        "curves.png",
        "eval.json",
        "confusion.png",
    }
)


def _run_before_the_marker(out: Path) -> bool:
    """A run folder written before folders were marked: only a run's files, and a
    checkpoint of ours among them."""
    names = {p.name for p in out.iterdir() if not p.name.startswith(".")}
    return names <= RUN_FILES and saved_options(out / CHECKPOINT) is not None


def check_out_folder(out: Path, force: bool = False) -> OutFolder:
    """Take ``out`` for a run: created if missing, a folder this process can write, new,
    empty or a run (``out_folder.claim``; ``force``: any folder). Not marked yet."""
    taken = claim(out, RUN, force=force, mark=False, legacy=_run_before_the_marker)
    if not os.access(out, os.W_OK | os.X_OK):
        release(taken)
        raise FinetuneError(f"the output folder {out} is not writable; choose another --out")
    return taken


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _holder(path: Path) -> int | None:
    """The pid in a lock file, or None if it cannot be read."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class RunLock:
    """``with RunLock(out):`` holds ``out`` for this process."""

    def __init__(self, out: Path, force: bool = False) -> None:
        self.out = out
        self.path = out / LOCK
        self.force = force
        self._taken: OutFolder | None = None

    def __enter__(self) -> RunLock:
        self._taken = taken = check_out_folder(self.out, self.force)
        try:
            self._take()
            if taken.ours:
                mark_folder(self.out, RUN)
        except BaseException:
            self._clean_folder()
            raise
        return self

    def _take(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = _holder(self.path)
                if pid is not None and pid != os.getpid() and _alive(pid):
                    raise FinetuneError(
                        f"{self.out} is in use by another run (pid {pid}, lock file "
                        f"{self.path}); wait for it to finish, or choose another --out"
                    ) from None
                log.warning("taking over %s, left by a run that is gone (pid %s)", self.path, pid)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            except OSError as exc:
                raise FinetuneError(f"cannot write in the output folder {self.out}: {exc}") from exc
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            return
        raise FinetuneError(f"cannot take the lock {self.path}: another run keeps taking it")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if _holder(self.path) == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._clean_folder()

    def _clean_folder(self) -> None:
        """Remove the folder if this run created it and wrote nothing in it."""
        if self._taken is not None:
            release(self._taken)
