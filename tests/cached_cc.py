"""Building an exported trainer in the tests with its kernels' object files shared between
builds: ``make_trainer(folder, *settings)`` runs ``make -s -C folder *settings`` with this
file as the compiler wrapper (``CC="python tests/cached_cc.py cc"``).

The trainer's Makefile compiles and links every source in one command. Through the
wrapper, each ``kernels/*.c`` of that command compiles alone, with the flags before the
sources, into an object file kept under ``$PE_TEST_CC_CACHE`` (set for the session by
tests/conftest.py) by the hash of the compiler's version, those flags and every file of
``kernels/``; the other sources then compile and link with the kept objects, with the
command's own flags, in the command's order. One process at a time builds the objects of
a key (the others wait on its lock file), each written under a temporary name and renamed.
A build of the same flags costs the step's own sources only (each kernel set takes 10-20 s
to build, longer with the sanitizers). Tests that build with flags no other test uses
call ``make`` directly.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["make_trainer"]

CACHE = "PE_TEST_CC_CACHE"


def make_trainer(folder: Path, *settings: str) -> None:
    """``make -s -C folder *settings`` with the kernels' objects shared (``CC=`` among
    ``settings`` names the compiler to wrap, else ``$CC`` or ``cc``)."""
    compiler = os.environ.get("CC") or "cc"
    rest = []
    for setting in settings:
        if setting.startswith("CC="):
            compiler = setting.removeprefix("CC=")
        else:
            rest.append(setting)
    wrapper = shlex.join([sys.executable, str(Path(__file__).resolve())])
    wrapped = f"CC={wrapper} {compiler}"
    subprocess.run(["make", "-s", "-C", str(folder), wrapped, *rest], check=True)


def _key(compiler: str, flags: list[str], kernels: Path) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    digest = hashlib.sha256(f"{compiler}\n{version.stdout}\n{flags}".encode())
    for path in sorted(kernels.iterdir()):
        digest.update(f"\n{path.name}\n".encode() + path.read_bytes())
    return digest.hexdigest()[:24]


def _object(compiler: str, flags: list[str], source: str, folder: Path) -> Path:
    obj = folder / (Path(source).stem + ".o")
    if not obj.exists():
        part = folder / f".{obj.name}.{os.getpid()}.tmp"
        subprocess.run([compiler, *flags, "-c", source, "-o", str(part)], check=True)
        part.replace(obj)
    return obj


def main(argv: list[str]) -> int:
    compiler, args = argv[0], argv[1:]
    at = [i for i, a in enumerate(args) if a.endswith(".c")]
    if not at or CACHE not in os.environ or "-c" in args:
        return subprocess.run([compiler, *args], check=False).returncode
    flags, sources, after = args[: at[0]], args[at[0] : at[-1] + 1], args[at[-1] + 1 :]
    kernels = [s for s in sources if Path(s).parent.name == "kernels"]
    if not kernels:
        return subprocess.run([compiler, *args], check=False).returncode
    folder = Path(os.environ[CACHE]) / _key(compiler, flags, Path(kernels[0]).parent)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:  # one process builds a set, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        linked = [str(_object(compiler, flags, s, folder)) if s in kernels else s for s in sources]
    return subprocess.run([compiler, *flags, *linked, *after], check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
