"""The generated step function's code object, parsed in a forked child where that is safe.

Parsing the step's source (``compile()``) takes memory out of all proportion to the code it
makes: CPython's parser builds the whole syntax tree, its tokens and memo tables in small
blocks among the objects the process keeps, and frees them afterwards. The MCU-class
head-only step (MobileNetV2 width 0.35, 128 px, batch 1: 109,000 characters of source)
took 5.3 MiB while it was parsed and left 0.75 MiB resident after a ``malloc_trim`` (Python
arenas and glibc heap that the freed tree no longer fills); the training memory of that
step was 13.5 MiB parsed here against 12.1 MiB with the same code parsed in a child
(docs/benchmarks.md, "The torch backend against eager").

``code_object`` parses a source of at least ``FORK_MIN_CHARS`` characters in a forked
child, which sends the code object back ``marshal``-ed: this process only unmarshals it
(0.1 MiB for that step). It is the same code object, bytecode for bytecode, with the same
file name and line numbers. The child runs nothing but ``compile`` and ``marshal`` and
leaves with ``os._exit``. Where a fork is not safe (not Linux, no ``os.fork``; a JAX
runtime, CUDA or TensorFlow started in this process, whose threads and contexts do not
survive one) or the child fails or takes longer than ``TIMEOUT_S``, the source is parsed
here, as a smaller one always is.
"""

from __future__ import annotations

import gc
import marshal
import os
import select
import signal
import sys
import time
import types
import warnings
from typing import NoReturn

__all__ = ["FORK_MIN_CHARS", "TIMEOUT_S", "code_object"]

FORK_MIN_CHARS = 32_000  # about 200 nodes; smaller sources leave little behind
TIMEOUT_S = 120.0


def code_object(source: str, filename: str) -> types.CodeType:
    """``compile(source, filename, "exec")``, parsed in a forked child when ``source`` is
    large and a fork is safe (the module docstring)."""
    if len(source) >= FORK_MIN_CHARS and _can_fork():
        code = _parsed_in_child(source, filename)
        if code is not None:
            return code
    return _parse_here(source, filename)


def _parse_here(source: str, filename: str) -> types.CodeType:
    return compile(source, filename, "exec")


def _can_fork() -> bool:
    """Linux with ``os.fork``, and no runtime here whose threads a fork would break."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    jax_started = bridge is not None and bool(bridge.backends_are_initialized())
    torch = sys.modules.get("torch")
    cuda = torch is not None and bool(torch.cuda.is_initialized())
    return not (jax_started or cuda or "tensorflow" in sys.modules)


def _parsed_in_child(source: str, filename: str) -> types.CodeType | None:
    """The code object from a forked child, or None where the fork or the child failed."""
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()
    gc.freeze()  # the child's collector never runs destructors of this process's objects
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns of forking beside threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    finally:
        gc.unfreeze()
    if pid == 0:
        _child(source, filename, read_fd, write_fd)
    os.close(write_fd)
    data = _read_all(read_fd, pid)
    if data is None:
        return None
    code = marshal.loads(data)
    return code if isinstance(code, types.CodeType) else None


def _child(source: str, filename: str, read_fd: int, write_fd: int) -> NoReturn:
    status = 1
    try:
        os.close(read_fd)
        data = marshal.dumps(compile(source, filename, "exec"))
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        status = 0
    finally:
        os._exit(status)


def _read_all(read_fd: int, pid: int) -> bytes | None:
    """What the child wrote, once it exited with status 0; None on a failure or timeout
    (the child is then killed)."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([read_fd], [], [], remaining)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    ok = os.waitstatus_to_exitcode(status) == 0 and chunks
    return b"".join(chunks) if ok else None
