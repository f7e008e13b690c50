"""Writing safetensors files tensor by tensor, without building the file in memory.

``safetensors.numpy.save`` returns the whole file as one ``bytes`` object: saving a model
then briefly holds a second copy of every weight, which on a small device is the run's
peak. ``write_safetensors_to`` writes the header, then each array's own bytes (a view,
never a copy), so saving costs no memory beyond the arrays already held. NumPy only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from pockengine._libc import page_out
from pockengine.ir.arrays import Array
from pockengine.safe_write import write_with

__all__ = [
    "SAFETENSORS_DTYPES",
    "LazyTensors",
    "SafetensorsError",
    "all_zero",
    "append_tensors",
    "header_bytes",
    "metadata_of",
    "pages_out_after_write",
    "read_header",
    "read_metadata",
    "write_rows",
    "write_safetensors_to",
    "write_streamed_to",
]

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
_BLOCK = 8 << 20  # bytes a copy of a non-C-ordered array's rows holds at most


def _c_order(tensors: Mapping[str, Array]) -> dict[str, Array]:
    arrays = {}
    for name, array in tensors.items():
        a = np.asarray(array)
        if a.dtype not in _NAMES:
            raise TypeError(f"{name}: {a.dtype} has no safetensors dtype")
        arrays[name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return arrays


def header_bytes(
    tensors: Mapping[str, Array],
    metadata: Mapping[str, str] | None = None,
    before: Mapping[str, Any] | None = None,
) -> bytes:
    """The 8-byte length and the JSON header (padded to 8 bytes) of ``tensors``, laid out
    in the given order, after the entries ``before`` (another header's, data kept)."""
    header: dict[str, Any] = dict(before or {})
    offset = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    for name, a in tensors.items():
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}  # fmt: skip
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors_to(
    f: IO[bytes],
    tensors: Mapping[str, Array],
    metadata: Mapping[str, str] | None = None,
    write: Callable[[IO[bytes], bytes | memoryview], None] | None = None,
) -> None:
    """``tensors`` as one safetensors file into ``f`` (little-endian, C order), each array
    written from its own memory. ``write(f, data)`` does the writing (default ``f.write``)."""
    put = write or (lambda out, data: out.write(data))
    arrays = _c_order(tensors)
    put(f, header_bytes(arrays, metadata))
    for a in arrays.values():
        if a.nbytes:
            put(f, a.reshape(-1).view(np.uint8).data)


def write_rows(f: IO[bytes], array: Array) -> None:
    """``array``'s bytes in C order, a block of rows at a time: a C-ordered array is
    written from its own memory, any other (a broadcast stand-in, a channels-last tensor)
    through copies of at most ``_BLOCK`` bytes."""
    if array.flags.c_contiguous:
        if array.nbytes:
            f.write(array.reshape(-1).view(np.uint8).data)
        return
    rows = max(1, _BLOCK // max(1, array[0].nbytes))
    for start in range(0, len(array), rows):
        write_rows(f, np.ascontiguousarray(array[start : start + rows]))


_PAGE_OUT = [False]  # pages_out_after_write is active


@contextlib.contextmanager
def pages_out_after_write() -> Iterator[None]:
    """Within it, ``write_streamed_to`` hands each tensor's pages back to the kernel once
    written (``_libc.page_out``). For a process about to exit that writes weights a loader
    memory-mapped and nothing else read (the compile child writing its step): reading
    them to write them would otherwise make every one resident at once."""
    _PAGE_OUT[0] = True
    try:
        yield
    finally:
        _PAGE_OUT[0] = False


def write_streamed_to(
    f: IO[bytes],
    specs: Mapping[str, Array],
    read: Callable[[str], Array],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """The tensors ``specs`` describes (shapes and dtypes; broadcast zeros serve) as one
    safetensors file into ``f``: the header first, then each ``read(name)`` written as
    soon as it is read (``write_rows``), so one tensor at a time is in memory."""
    f.write(header_bytes(specs, metadata))
    for name in specs:
        array = read(name)
        if not _PAGE_OUT[0] or not array.flags.c_contiguous:
            write_rows(f, array)
            continue
        for block in _flat_blocks(array):  # a block resident at a time
            f.write(block.data)
            page_out(block)


def _flat_blocks(array: Array) -> Iterator[Array]:
    """A C-contiguous ``array``'s bytes as views of at most ``_BLOCK`` bytes."""
    flat = array.reshape(-1).view(np.uint8)
    for start in range(0, len(flat), _BLOCK):
        yield flat[start : start + _BLOCK]


def all_zero(array: Array) -> bool:
    """Whether every byte of ``array`` is zero (-0.0 is not); within
    ``pages_out_after_write`` read a block at a time, each block's pages handed back."""
    if not _PAGE_OUT[0] or not array.flags.c_contiguous:
        return not np.ascontiguousarray(array).reshape(-1).view(np.uint8).any()
    for block in _flat_blocks(array):
        nonzero = bool(block.any())
        page_out(block)
        if nonzero:
            return False
    return True


def append_tensors(path: Path, tensors: Mapping[str, Array]) -> None:
    """Rewrite the safetensors file ``path`` with ``tensors`` added after its own: its
    data are copied through in chunks (none of its tensors is read into memory); the new
    file replaces the old one atomically."""
    arrays = _c_order(tensors)
    with path.open("rb") as src:
        header = read_header(src)[1]
        metadata = header.pop("__metadata__", None)

        def fill(dst: IO[bytes]) -> None:
            dst.write(header_bytes(arrays, metadata, before=header))
            shutil.copyfileobj(src, dst, 8 << 20)
            for a in arrays.values():
                if a.nbytes:
                    dst.write(a.reshape(-1).view(np.uint8).data)

        write_with(path, fill)


def metadata_of(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file from its first bytes (at least the
    8-byte size and the JSON header); a ``ValueError`` when it is not a string map."""
    return _metadata(read_header(io.BytesIO(data))[1])


def _metadata(header: Mapping[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("bad safetensors metadata")
    return {str(k): str(v) for k, v in meta.items()}


def read_header(f: IO[bytes], limit: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """The JSON header of the safetensors file open as ``f`` (at its start), as its bytes
    and parsed (``__metadata__`` included); ``f`` is left where the tensor data begin, at
    ``8 + len(bytes)``. A ``ValueError`` for a file shorter than the size field or than the
    header it announces, a header that is not a JSON object, or, with ``limit``, a header
    size outside (0, ``limit``]."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"not a safetensors file ({len(head)} bytes, short of its size field)")
    size = int.from_bytes(head, "little")
    if limit is not None and not 0 < size <= limit:
        raise ValueError(f"not a safetensors header (size {size})")
    raw = f.read(size)
    if len(raw) < size:
        raise ValueError(f"truncated safetensors header ({len(raw)} of {size} bytes)")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("not a safetensors header (not a JSON object)")
    return raw, header


def read_metadata(path: str | os.PathLike[str], limit: int = 100 << 20) -> dict[str, str]:
    """The ``__metadata__`` of the safetensors file ``path``, reading its header alone;
    a ``ValueError`` for a header size outside (0, ``limit``], an ``OSError`` unread."""
    with Path(path).open("rb") as f:
        try:
            header = read_header(f, limit)[1]
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return _metadata(header)


class SafetensorsError(ValueError):
    """A safetensors file whose tensor data do not match its header (the message names
    the file and the tensor)."""


class LazyTensors(Mapping[str, Array]):
    """The tensors of the safetensors file ``path`` by name, each read from the file when
    it is looked up (a fresh array; nothing is held between lookups): a writer that goes
    through them one at a time never has the whole file in memory. ``file_size`` is the
    size the header implies; ``in_file_order`` and ``read_from`` read them all through one
    open file (``artifact.read_tensors``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            raw, header = read_header(f)
        header.pop("__metadata__", None)
        self._start = 8 + len(raw)
        self._entries = header
        self.file_size = self._start + max(
            (int(e["data_offsets"][1]) for e in header.values()), default=0
        )

    def __getitem__(self, name: str) -> Array:
        entry = self._entries[name]  # a KeyError before the file is opened
        with self.path.open("rb") as f:
            return self._read(f, name, entry)

    def read_from(self, f: io.BufferedIOBase, name: str) -> Array:
        """Tensor ``name`` read through ``f``, this file opened for reading."""
        return self._read(f, name, self._entries[name])

    def _read(self, f: io.BufferedIOBase, name: str, entry: Mapping[str, Any]) -> Array:
        array = np.empty([int(d) for d in entry["shape"]], SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = (int(x) for x in entry["data_offsets"])
        if end - begin != array.nbytes:
            raise SafetensorsError(
                f"{self.path}: {name} holds {end - begin} bytes, its shape needs {array.nbytes}"
            )
        f.seek(self._start + begin)
        if array.nbytes and f.readinto(array.reshape(-1).view(np.uint8).data) != end - begin:
            raise SafetensorsError(f"{self.path}: {name} is cut short")
        return array

    def in_file_order(self) -> list[str]:
        """The names by where their data start (reading them so never seeks back)."""
        return sorted(self._entries, key=lambda n: int(self._entries[n]["data_offsets"][0]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
