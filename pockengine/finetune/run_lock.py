"""One output folder, one run: a lock file naming the pid of the run that holds it.

Two runs writing one ``--out`` would interleave checkpoints and metrics. ``RunLock``
checks the folder (a folder, creatable, writable) before any work starts, then creates
``.pockengine.lock`` holding its pid with ``O_EXCL``. A lock whose pid is alive refuses
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

from pockengine.finetune.config import FinetuneError

__all__ = ["LOCK", "RunLock", "check_out_folder"]

log = logging.getLogger(__name__)
LOCK = ".pockengine.lock"


def check_out_folder(out: Path) -> bool:
    """Make sure ``out`` is a folder this process can write (created if missing); returns
    whether it was created."""
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--out {out} is a file, not a folder; choose another --out")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FinetuneError(f"cannot create the output folder {out}: {exc}") from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise FinetuneError(f"the output folder {out} is not writable; choose another --out")
    return created


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

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / LOCK
        self._created = False

    def __enter__(self) -> RunLock:
        self._created = check_out_folder(self.out)
        try:
            self._take()
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
        if self._created:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only succeeds when empty
