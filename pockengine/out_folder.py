"""Output folders: which folders a command may write into, and whole folders built aside.

A folder given with ``--out`` / ``-o`` (``pockengine finetune``, ``export``, ``federated``)
is written only if it is

- new (it is created), or empty; or
- recognisably ours, of the same kind: it holds ``.pockengine-folder``, a small JSON file
  (``{"kind": "fine-tune run"}``, ``"export"`` or ``"federation"``) that the command
  writes when it takes a new or empty folder (a fine-tune run from before the marker is
  recognised by its checkpoint, when it holds nothing a run does not write).

Anything else is refused with one ``OutFolderError`` line naming the folder and what is
in it, before any work starts. ``--force`` writes into such a folder anyway, but only the
files the command writes are replaced: nothing else is deleted, and a folder the command
writes (``model/``, ``kernels/``) is merged file by file instead of replaced whole. A
forced folder is not marked, so the next run into it needs ``--force`` again.

``building(out)`` builds a whole folder (an export) in a temporary sibling and puts it in
place at the end: a failure leaves nothing behind, and an existing folder of ours is
replaced only once the new one is complete. ``install_folder`` does the same for a folder
built by other means (a run's ``model/``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pockengine.ir import PockEngineError
from pockengine.safe_write import UnsafeWriteError, check_no_links, temporary_name, write_json

__all__ = [
    "EXPORT",
    "FEDERATION",
    "MARKER",
    "RUN",
    "OutFolder",
    "OutFolderError",
    "building",
    "claim",
    "install_folder",
    "kind_of",
    "mark_folder",
    "release",
]

MARKER = ".pockengine-folder"
RUN, EXPORT, FEDERATION = "fine-tune run", "export", "federation"
_LOCK = ".pockengine.lock"  # finetune.running.run_lock.LOCK
_SHOWN = 6  # entries a refusal names


class OutFolderError(PockEngineError):
    """An output folder pockengine will not write into: it holds files that are not
    its own, or a folder of another kind, or it is not a folder."""


@dataclass(frozen=True)
class OutFolder:
    """A folder a command has taken. ``ours``: marked as of its kind (or new, or empty):
    the files and folders the command writes may be replaced whole; otherwise (``--force``
    over a folder that is not ours) only file by file. ``created``: made by ``claim``."""

    path: Path
    kind: str
    ours: bool
    created: bool = False


def _ignorable(name: str) -> bool:
    """Entries an empty folder may hold: the marker, a run's lock, our temporaries."""
    return name in (MARKER, _LOCK) or (name.startswith(".") and name.endswith(".tmp"))


def kind_of(folder: Path) -> str | None:
    """The kind ``folder``'s marker names, or None (no marker, or not a readable one)."""
    path = folder / MARKER
    try:
        if path.is_symlink() or path.stat().st_size > 4096:
            return None
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


def _a(kind: str) -> str:
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _contents(folder: Path) -> list[str]:
    return sorted(
        p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
        for p in folder.iterdir()
        if not _ignorable(p.name)
    )


def claim(
    path: Path,
    kind: str,
    *,
    force: bool = False,
    option: str = "--out",
    inside: Path | None = None,
    create: bool = True,
    mark: bool = True,
    legacy: Callable[[Path], bool] | None = None,
) -> OutFolder:
    """Take ``path`` as the output folder of a ``kind`` command, or refuse it
    (``OutFolderError``). ``inside``: the folder the user gave, when ``path`` was derived
    from it (``RUN/export_c``): no link between them is followed. ``create``: make a new
    folder now (else it is left to ``building``); ``mark``: mark a folder taken as ours
    now (else the caller does, with ``mark_folder``). ``legacy(path)``: whether an
    unmarked folder is ours from before the marker."""
    path = Path(path)
    if inside is not None:  # a folder the user named may be a link; one derived may not
        check_no_links(path, inside)
    if path.exists() and not path.is_dir():
        raise OutFolderError(f"{option} {path} is a file, not a folder; choose another {option}")
    if not path.exists():
        if create:
            try:
                path.mkdir(parents=True)
            except OSError as exc:
                raise OutFolderError(f"cannot create the folder {option} {path}: {exc}") from exc
            if mark:
                mark_folder(path, kind)
        return OutFolder(path, kind, ours=True, created=create)
    taken = _existing(path, kind, force=force, option=option, legacy=legacy)
    if mark and taken.ours:
        mark_folder(path, kind)
    return taken


def _existing(
    path: Path, kind: str, *, force: bool, option: str, legacy: Callable[[Path], bool] | None
) -> OutFolder:
    try:
        contents = _contents(path)
    except OSError as exc:
        raise OutFolderError(f"cannot read the folder {option} {path}: {exc}") from exc
    marked = kind_of(path)
    if marked == kind or (not contents and marked is None):
        return OutFolder(path, kind, ours=True)
    if marked is None and legacy is not None and legacy(path):
        return OutFolder(path, kind, ours=True)
    if force:
        return OutFolder(path, kind, ours=False)
    if marked is not None:
        what = f"is {_a(marked)} folder of pockengine, not {_a(kind)}"
    else:
        what = f"is not empty and not {_a(kind)} of pockengine (it holds {_listing(contents)})"
    raise OutFolderError(
        f"{option} {path} {what}; choose a new or empty folder, or add --force to write "
        "there anyway (only the files pockengine writes are replaced, nothing else is deleted)"
    )


def mark_folder(folder: Path, kind: str) -> None:
    """Mark ``folder`` as ours, of ``kind`` (unless it is already)."""
    if kind_of(folder) == kind:
        return
    try:
        write_json(folder / MARKER, {"kind": kind}, inside=folder)
    except OSError as exc:
        raise OutFolderError(f"cannot write in the output folder {folder}: {exc}") from exc


def release(out: OutFolder) -> None:
    """Remove ``out`` if ``claim`` created it and nothing but the marker was written."""
    if not out.created:
        return
    with contextlib.suppress(OSError):
        if [p.name for p in out.path.iterdir()] == [MARKER]:
            (out.path / MARKER).unlink()
        out.path.rmdir()  # only succeeds when empty


# -- whole folders, built aside ------------------------------------------------------------


@contextlib.contextmanager
def building(out: OutFolder) -> Iterator[Path]:
    """A fresh temporary sibling of ``out.path`` to fill; on a clean exit it is put in
    place (``install_folder``), marked as ``out.kind`` when ``out.ours``; on an error it is
    removed and ``out.path`` is left as it was."""
    target = out.path
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if out.ours:
            mark_folder(tmp, out.kind)
        install_folder(tmp, target, merge=not out.ours)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # the parents this build made, innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _as_open_would(folder: Path) -> None:
    """The permissions ``mkdir`` gives (``mkdtemp`` makes an owner-only folder)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)


def install_folder(tmp: Path, target: Path, *, merge: bool = False) -> None:
    """Put the folder ``tmp`` (a sibling of ``target``) at ``target``. Whole: an existing
    ``target`` is moved aside, the new one renamed in, the old one removed. ``merge``: each
    file of ``tmp`` replaces the file of that name under ``target`` and nothing else there
    is touched. A link at ``target`` or under it, on the way of a file, is refused."""
    _as_open_would(tmp)
    mode = _mode(target)
    if mode is not None and stat.S_ISLNK(mode):
        raise UnsafeWriteError(f"refusing to write {target}: it is a symbolic link")
    if mode is not None and not stat.S_ISDIR(mode):
        raise UnsafeWriteError(f"refusing to write {target}: it is a file, not a folder")
    if mode is None:
        os.replace(tmp, target)
    elif merge:
        _check_merge(tmp, target)
        _merge(tmp, target)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = target.with_name(temporary_name(target.name))
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)


def _mode(path: Path) -> int | None:
    try:
        return path.lstat().st_mode
    except FileNotFoundError:
        return None


def _check_merge(src: Path, dst: Path) -> None:
    """Refuse before anything moves: a link, or a file where a folder goes (or back)."""
    for entry in src.iterdir():
        there = dst / entry.name
        mode = _mode(there)
        if mode is None:
            continue
        if stat.S_ISLNK(mode):
            raise UnsafeWriteError(f"refusing to write {there}: it is a symbolic link")
        if entry.is_dir() != stat.S_ISDIR(mode):
            want = "a folder" if entry.is_dir() else "a file"
            raise UnsafeWriteError(f"refusing to write {there}: pockengine writes {want} there")
        if entry.is_dir():
            _check_merge(entry, there)


def _merge(src: Path, dst: Path) -> None:
    for entry in src.iterdir():
        there = dst / entry.name
        if entry.is_dir() and there.is_dir():
            _merge(entry, there)
        else:
            os.replace(entry, there)
