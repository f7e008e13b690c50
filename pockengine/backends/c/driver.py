"""The C driver: compile a step's source with the system compiler, cache, load.

The compiler is ``$CC`` or ``cc``; flags are ``-O3 -march=native`` by default, ``-O3``
alone for a portable build (``portable=True`` or ``PE_C_PORTABLE=1``), plus ``-fopenmp``
when the compiler takes it (probed once) unless turned off (``openmp=False`` or
``PE_C_OPENMP=0``), and always ``-std=c11 -fno-math-errno`` (no contraction into fused
multiply-adds, which ISO C mode turns off, and vectorised square roots). The kernel files
(``kernels/*.c``) compile once per compiler and flags into object files, one compiler
process per core at once; each step compiles its one source and links them into a shared
library. Both are cached by the hash of everything that goes in (the sources, the
compiler's version line, the flags) under ``$PE_C_CACHE``, else
``$XDG_CACHE_HOME/pockengine/c``, else ``~/.cache/pockengine/c``; files are written under
a temporary name and renamed, so concurrent processes share the cache safely.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pockengine.ir import PockEngineError

__all__ = [
    "KERNEL_DIR",
    "CCompileError",
    "Toolchain",
    "build_library",
    "cache_dir",
    "has_fast_gemm",
    "kernel_sources",
    "toolchain",
]

KERNEL_DIR = Path(__file__).with_name("kernels")


class CCompileError(PockEngineError):
    """The C compiler is missing or rejected a source; the message holds its output."""


@dataclass(frozen=True)
class Toolchain:
    compiler: str
    version: str
    flags: tuple[str, ...]  # optimisation and OpenMP flags, also used when linking
    openmp: bool

    @property
    def key(self) -> str:
        return f"{self.compiler}\n{self.version}\n{' '.join(self.flags)}"


def cache_dir() -> Path:
    """Where compiled kernels and steps are kept (created on first use)."""
    root = os.environ.get("PE_C_CACHE")
    if root:
        path = Path(root)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "pockengine" / "c"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise CCompileError(
            f"the C compiler {cmd[0]!r} was not found: install a C11 compiler (gcc or clang) "
            "or set $CC"
        ) from None
    if done.returncode != 0:
        raise CCompileError(f"{what} failed:\n$ {' '.join(cmd)}\n{done.stderr[-4000:]}")


@functools.cache
def _probe(compiler: str, portable: bool, want_openmp: bool) -> Toolchain:
    if shutil.which(compiler) is None:
        raise CCompileError(
            f"the C compiler {compiler!r} was not found: install gcc or clang, or set $CC"
        )
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    flags = ["-O3"] if portable else ["-O3", "-march=native"]
    openmp = False
    with tempfile.TemporaryDirectory() as tmp:
        if not want_openmp:
            return Toolchain(compiler, version[0] if version else "", tuple(flags), False)
        src = Path(tmp, "omp.c")
        src.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        done = subprocess.run(
            [compiler, "-fopenmp", str(src), "-o", str(Path(tmp, "omp"))],
            capture_output=True,
            check=False,
        )
        openmp = done.returncode == 0
    if openmp:
        flags.append("-fopenmp")
    return Toolchain(compiler, version[0] if version else "", tuple(flags), openmp)


def toolchain(portable: bool | None = None, openmp: bool | None = None) -> Toolchain:
    """The compiler and flags in use (``$CC``, ``$PE_C_PORTABLE``, ``$PE_C_OPENMP=0``)."""
    if portable is None:
        portable = os.environ.get("PE_C_PORTABLE", "") not in ("", "0")
    if openmp is None:
        openmp = os.environ.get("PE_C_OPENMP", "1") != "0"
    return _probe(os.environ.get("CC") or "cc", portable, openmp)


@functools.cache
def _predefined(compiler: str, flags: tuple[str, ...]) -> frozenset[str]:
    """The macros ``compiler`` predefines with ``flags`` (none when it cannot say)."""
    done = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return frozenset()
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.count(" ") >= 1)


def has_fast_gemm(portable: bool | None = None) -> bool:
    """Whether the build has the GEMM's wide FMA micro-kernels (AVX-512, or AVX2 with FMA:
    ``PE_FAST_GEMM`` in ``kernels/pe_isa.h``), where the implicit GEMM beats Winograd
    F(2x2, 3x3) on many channels (``conv_kernels.rule_kernel``)."""
    tc = toolchain(portable, openmp=False)
    macros = _predefined(tc.compiler, tc.flags)
    return "__AVX512F__" in macros or {"__AVX2__", "__FMA__"} <= macros


def kernel_sources() -> list[Path]:
    """The kernel files, in a fixed order (``.c`` compiled, ``.h`` included)."""
    return sorted(p for p in KERNEL_DIR.iterdir() if p.suffix in (".c", ".h"))


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:20]


# -fno-math-errno: sqrt need not set errno, so loops that take roots vectorise (the AdamW
# updates: 6x faster); every result stays the correctly rounded IEEE one.
_COMMON = ("-std=c11", "-fPIC", "-D_POSIX_C_SOURCE=200809L", "-fno-math-errno")


def _kernel_objects(tc: Toolchain) -> list[Path]:
    sources = kernel_sources()
    digest = _digest(tc.key, *_COMMON, *(p.read_bytes() for p in sources))
    folder = cache_dir() / f"kernels-{digest}"
    objects = [folder / f"{p.stem}.o" for p in sources if p.suffix == ".c"]
    if all(o.exists() for o in objects):
        return objects
    folder.mkdir(parents=True, exist_ok=True)
    todo = [
        (src, obj)
        for src, obj in zip((p for p in sources if p.suffix == ".c"), objects, strict=True)
        if not obj.exists()
    ]
    # one compiler process per core at once; the first failure is raised
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        for done in [pool.submit(_compile_kernel, tc, src, obj) for src, obj in todo]:
            done.result()
    return objects


def _compile_kernel(tc: Toolchain, src: Path, obj: Path) -> None:
    tmp = obj.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp.o")
    _run(
        [tc.compiler, *tc.flags, *_COMMON, "-I", str(KERNEL_DIR), "-c", str(src), "-o", str(tmp)],
        f"compiling kernel {src.name}",
    )
    os.replace(tmp, obj)


def build_library(source: str, portable: bool | None = None, openmp: bool | None = None) -> Path:
    """The shared library of one step's ``source`` linked with the kernels (cached)."""
    tc = toolchain(portable, openmp)
    objects = _kernel_objects(tc)
    digest = _digest(tc.key, *_COMMON, source, *(str(o) for o in objects))
    library = cache_dir() / f"step-{digest}.so"
    if library.exists():
        return library
    src = cache_dir() / f"step-{digest}.c"
    staged = src.with_suffix(f".{os.getpid()}.tmp.c")
    staged.write_text(source)
    os.replace(staged, src)
    tmp = library.with_suffix(f".{os.getpid()}.tmp.so")
    _run(
        [
            tc.compiler,
            *tc.flags,
            *_COMMON,
            "-shared",
            "-I",
            str(KERNEL_DIR),
            str(src),
            *(str(o) for o in objects),
            "-o",
            str(tmp),
            "-lm",
        ],
        "compiling the step",
    )
    os.replace(tmp, library)
    return library
