"""Writing files so that a write lands where it was meant to, whole, or not at all.

Every file the CLI and the trainer write goes through here:

- ``write_bytes``, ``write_text``, ``write_json`` and ``write_with`` (a callback that
  fills an open binary file: matplotlib's ``savefig``, ``np.save``, a safetensors writer)
  write a temporary file in the target's folder, flush and fsync it, and ``os.replace`` it
  over the target, so a crash or a full disk leaves the previous file or the new one,
  never a mixture;
- ``append_text`` appends to a log (``metrics.jsonl``), opened with ``O_NOFOLLOW``.

None of them follows a symbolic link: the target itself must not be one, nor any folder
between ``inside`` (the folder the user gave, which may itself be reached through links)
and the target. Folders are walked one at a time with ``O_NOFOLLOW | O_DIRECTORY`` and the
file is opened, renamed and appended relative to the folder's descriptor, so a link
planted in a run folder cannot send a write elsewhere. The temporary file is created with
``O_EXCL | O_NOFOLLOW`` under a random name: a planted name makes the write fail, it is
never written through. A refused write is an ``UnsafeWriteError`` naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from pockengine.ir import PockEngineError

__all__ = [
    "UnsafeWriteError",
    "append_text",
    "check_no_links",
    "make_dirs",
    "open_folder",
    "temporary_name",
    "write_bytes",
    "write_json",
    "write_text",
    "write_with",
]

_CHUNK = 8 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeWriteError(PockEngineError, OSError):
    """A write refused: its target, or a folder on its way, is a symbolic link (or not
    what a write needs: a folder where a file goes). Also an ``OSError``, so code that
    treats an unwritable file as a warning treats this one the same."""


def temporary_name(name: str) -> str:
    """The name of a temporary file for ``name`` (``.NAME.<random>.tmp``: what
    ``finetune.run_folder.checkpoint.remove_stale_temporaries`` looks for)."""
    return f".{name}.{secrets.token_hex(4)}.tmp"


def _below(path: Path, inside: Path | None) -> tuple[Path, list[str]]:
    """The folder to open as given, and the names under it down to ``path``; without
    ``inside`` (or with one that does not hold ``path``) only ``path`` itself is checked."""
    if inside is not None:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(inside))
        parts = Path(rel).parts
        if rel != "." and parts[0] != os.pardir:
            return inside, list(parts)
    return path.parent, [path.name]


def _refuse(path: Path, why: str) -> UnsafeWriteError:
    return UnsafeWriteError(f"refusing to write {path}: {why}")


def _kind_at(dir_fd: int, name: str) -> int | None:
    """The ``st_mode`` of ``name`` in the folder, not following a link; None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def open_folder(folder: Path, inside: Path | None = None, *, create: bool = True) -> Iterator[int]:
    """A descriptor of ``folder``, reached from ``inside`` one folder at a time without
    following a link (missing folders are made with ``create``); closed on exit."""
    start, names = _below(folder / "_", inside)
    names = names[:-1]
    try:
        fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
        start.mkdir(parents=True, exist_ok=True)
        fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise _refuse(folder, f"{start} is not a folder") from None
    try:
        walked = start
        for name in names:
            walked = walked / name
            mode = _kind_at(fd, name)
            if mode is None and create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                mode = _kind_at(fd, name)
            if mode is not None and stat.S_ISLNK(mode):
                raise _refuse(folder, f"{walked} is a symbolic link")
            if mode is not None and not stat.S_ISDIR(mode):
                raise _refuse(folder, f"{walked} is not a folder")
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(folder, f"{walked} is a symbolic link") from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def make_dirs(folder: Path, inside: Path | None = None) -> Path:
    """Make ``folder`` (and the folders above it, below ``inside``) without following a
    link; its path."""
    with open_folder(folder, inside):
        return folder


def check_no_links(path: Path, inside: Path | None = None) -> None:
    """Refuse ``path`` if it, or a folder between ``inside`` and it, is a symbolic link."""
    start, names = _below(path, inside)
    walked = start
    for name in names:
        walked = walked / name
        with contextlib.suppress(FileNotFoundError):
            if walked.is_symlink():
                raise _refuse(path, f"{walked} is a symbolic link")


def _check_target(dir_fd: int, path: Path) -> None:
    mode = _kind_at(dir_fd, path.name)
    if mode is not None and stat.S_ISLNK(mode):
        raise _refuse(path, "it is a symbolic link (remove it, or choose another folder)")
    if mode is not None and stat.S_ISDIR(mode):
        raise _refuse(path, "it is a folder")


def _write_chunks(f: IO[bytes], data: bytes | memoryview) -> None:
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        f.write(view[start : start + _CHUNK])


def write_with(path: Path, fill: Callable[[IO[bytes]], object], inside: Path | None = None) -> Path:
    """Replace ``path`` by what ``fill(f)`` writes into a fresh binary file; a write that
    fails or is interrupted leaves ``path`` as it was. Returns ``path``."""
    path = Path(path)
    with open_folder(path.parent, inside) as dir_fd:
        _check_target(dir_fd, path)
        tmp = temporary_name(path.name)
        try:
            fd = os.open(tmp, _NEW_FILE, 0o666, dir_fd=dir_fd)  # the umask applies, as open()
        except FileExistsError:  # planted under a random name: never written through
            raise _refuse(path, f"its temporary file {path.parent / tmp} exists") from None
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            _check_target(dir_fd, path)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        with contextlib.suppress(OSError):  # the rename itself durable, where possible
            os.fsync(dir_fd)
    return path


def write_bytes(path: Path, data: bytes | memoryview, inside: Path | None = None) -> Path:
    """Replace ``path`` by ``data`` (``write_with``)."""
    return write_with(path, lambda f: _write_chunks(f, data), inside)


def write_text(path: Path, text: str, inside: Path | None = None) -> Path:
    """Replace ``path`` by ``text`` in UTF-8 (``write_with``)."""
    return write_bytes(path, text.encode("utf-8"), inside)


def write_json(path: Path, value: Any, inside: Path | None = None, indent: int | None = 2) -> Path:
    """Replace ``path`` by ``value`` as JSON, with a final newline (``write_with``)."""
    return write_text(path, json.dumps(value, indent=indent) + "\n", inside)


def append_text(path: Path, text: str, inside: Path | None = None) -> None:
    """Append ``text`` to ``path`` (created if missing) and flush it; a link is refused."""
    path = Path(path)
    with open_folder(path.parent, inside) as dir_fd:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path.name, flags, 0o666, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refuse(path, "it is a symbolic link") from None
            raise
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
