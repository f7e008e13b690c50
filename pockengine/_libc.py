"""The C library's memory functions, where the process has glibc (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function"]


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
