"""The C library's memory functions, where the process has glibc (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function", "page_out"]


@functools.cache
def libc_function(name: str) -> Callable[..., Any] | None:
    """``name`` from the C library (``malloc_trim``, ``mallopt``), or None where it has no
    such function. Looked up once: ``find_library`` runs ``ldconfig`` in a subprocess."""
    path = ctypes.util.find_library("c")
    if not path:
        return None
    try:
        fn: Callable[..., Any] = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None
    return fn


MADV_PAGEOUT = 21  # Linux 5.4+


def page_out(array: Any) -> bool:
    """Ask the kernel to reclaim the whole pages of a C-contiguous NumPy ``array``
    (``madvise(MADV_PAGEOUT)``). A hint that changes no value: a page mapped from a file
    (a model's weights that a loader memory-mapped, read once to be written out) leaves
    the process's resident memory and is read from the file again if touched; an
    anonymous page stays unless the machine has swap. A no-op where the call is missing or
    refused (another kernel, another C library): False then."""
    madvise = libc_function("madvise")
    if madvise is None or not array.flags.c_contiguous:
        return False
    page = mmap.PAGESIZE
    address = array.__array_interface__["data"][0]
    start = -(-address // page) * page
    end = (address + array.nbytes) // page * page
    if end <= start:
        return True  # no whole page: nothing to hand back
    advice = ctypes.c_int(MADV_PAGEOUT)
    return int(madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)) == 0
