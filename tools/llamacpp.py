"""llama.cpp, built from the ``llama-cpp-python`` source distribution, as a check of our
GGUF LoRA adapters: does llama.cpp load ``pockengine export --target gguf-lora``'s file,
and give the fine-tuned model's next-token logits?

```bash
python tools/llamacpp.py build                  # once, cached (~10 min on 2 busy cores)
python tools/llamacpp.py compare RUN            # llama.cpp's logits against ours
```

``build`` downloads the sdist with pip (``pip download --no-binary :all: --no-deps
llama-cpp-python==VERSION``), unpacks its vendored llama.cpp into
``~/.cache/pockengine/llamacpp-VERSION/src`` (``$PE_CACHE`` moves the cache), builds only
the ``llama`` shared library with CMake (CPU, ``GGML_NATIVE``, Release, no tests, tools,
examples or server) and compiles a small C shim against ``llama.h``
(``tools/llamacpp_shim.c``): one call loads a
GGUF model, optionally a LoRA adapter (``llama_adapter_lora_init`` and
``llama_set_adapter_lora``, the calls ``llama-cli --lora`` makes), evaluates a prompt of
token ids and copies out the last position's logits. The shim keeps ctypes away from
llama.cpp's by-value parameter structs, whose layout changes between versions.
``BUILD.json`` in the folder records the version, the llama.cpp commit and the build time.

``compare RUN`` evaluates a prompt in llama.cpp on the run's GGUF base model, without and
with the run's adapter (exported to a temporary folder), and in PyTorch on the same
dequantized weights (the base, and ``RUN/model``: the base with the LoRA product merged),
and prints the agreement (``agreement``).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "VERSION",
    "Agreement",
    "LlamaCpp",
    "LlamaCppError",
    "LlamaCppUnavailable",
    "agreement",
    "build",
]

VERSION = "0.3.16"  # llama-cpp-python; vendors llama.cpp 4227c9be (CHANGELOG.md)
_CMAKE_ARGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
]  # fmt: skip
_SHIM = Path(__file__).with_name("llamacpp_shim.c")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built here (no cmake, no sdist, a failed build): the reason."""


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model or adapter; its last error line."""


def cache_dir(version: str = VERSION) -> Path:
    root = Path(os.environ.get("PE_CACHE", "~/.cache/pockengine")).expanduser()
    return root / f"llamacpp-{version}"


def _run(cmd: Sequence[str], log: Path, what: str) -> None:
    with log.open("a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        raise LlamaCppUnavailable(
            f"{what} failed (exit {done.returncode}; {log}): {' | '.join(tail)}"
        )


def _sdist(folder: Path, version: str, log: Path) -> Path:
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (folder / name).is_file():
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-d", str(folder), f"llama-cpp-python=={version}"]  # fmt: skip
        _run(pip, log, f"pip download llama-cpp-python=={version}")
    if not (folder / name).is_file():
        raise LlamaCppUnavailable(f"pip download left no {name} in {folder}")
    return folder / name


def _commit(sdist: Path) -> str:
    """The llama.cpp commit the sdist vendors, as its CHANGELOG names it."""
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        log = tar.extractfile(f"{top}/CHANGELOG.md")
        text = log.read().decode() if log is not None else ""
    for line in text.splitlines():
        if "llama.cpp@" in line:
            return line.split("llama.cpp@", 1)[1].split()[0]
    return "unknown"


def _unpack(sdist: Path, src: Path) -> None:
    """The sdist's ``vendor/llama.cpp`` into ``src`` (whole, or not at all)."""
    if (src / "include" / "llama.h").is_file():
        return
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=src.parent))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(tmp, members=members, filter="data")
    if not (tmp / "include" / "llama.h").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise LlamaCppUnavailable(f"{sdist} carries no vendor/llama.cpp/include/llama.h")
    shutil.rmtree(src, ignore_errors=True)
    os.replace(tmp, src)


def _built(folder: Path) -> bool:
    """Built, with the shim of this checkout's source."""
    source = folder / "pe_llama.c"
    return (
        (folder / "BUILD.json").is_file()
        and (folder / "libpe_llama.so").is_file()
        and source.is_file()
        and source.read_text(encoding="utf-8") == _SHIM.read_text(encoding="utf-8")
    )


def build(version: str = VERSION) -> Path:
    """The shim library of llama.cpp ``version`` (a llama-cpp-python version), built once
    into ``cache_dir(version)``; ``LlamaCppUnavailable`` names why it cannot be."""
    folder = cache_dir(version)
    shim = folder / "libpe_llama.so"
    if _built(folder):
        return shim
    for tool in ("cmake", "ninja", "cc"):
        if shutil.which(tool) is None:
            raise LlamaCppUnavailable(f"no {tool} on PATH to build llama.cpp")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits for the first
        if _built(folder):
            return shim
        return _build_locked(folder, version)


def _build_locked(folder: Path, version: str) -> Path:
    start = time.perf_counter()
    log = folder / "build.log"
    src, out = folder / "src", folder / "build"
    sdist = _sdist(folder, version, log)
    _unpack(sdist, src)
    _run(["cmake", "-S", str(src), "-B", str(out), *_CMAKE_ARGS], log, "cmake configure")
    _run(["cmake", "--build", str(out), "--target", "llama", "-j2"], log, "cmake build")
    shutil.copyfile(_SHIM, folder / "pe_llama.c")
    lib = out / "bin"
    cc = ["cc", "-O2", "-shared", "-fPIC", str(folder / "pe_llama.c"),
          f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{lib}", "-lllama",
          f"-Wl,-rpath,{lib}", "-o", str(folder / "libpe_llama.so")]  # fmt: skip
    _run(cc, log, "compiling the shim")
    info = {
        "llama_cpp_python": version,
        "llama_cpp_commit": _commit(sdist),
        "cmake_args": _CMAKE_ARGS,
        "build_s": round(time.perf_counter() - start, 1),
    }
    if (folder / "BUILD.json").is_file():  # a rebuilt shim keeps the library's build time
        info["build_s"] = json.loads((folder / "BUILD.json").read_text())["build_s"]
    (folder / "BUILD.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return folder / "libpe_llama.so"


def build_info(version: str = VERSION) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((cache_dir(version) / "BUILD.json").read_text())
    return data


class LlamaCpp:
    """The built shim: ``last_logits`` of a prompt, with or without a LoRA adapter."""

    def __init__(self, lib: Path) -> None:
        self._lib = ctypes.CDLL(str(lib))
        fn = self._lib.pe_llama_last_logits
        fn.restype = ctypes.c_int32
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_float,
                       ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_int32,
                       ctypes.POINTER(ctypes.c_float), ctypes.c_int32]  # fmt: skip
        self._lib.pe_llama_error.restype = ctypes.c_char_p

    def last_logits(
        self,
        model: Path,
        tokens: Sequence[int],
        *,
        lora: Path | None = None,
        scale: float = 1.0,
        threads: int = 1,
        max_vocab: int = 1 << 20,
    ) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The logits llama.cpp gives after ``tokens`` on ``model`` (+ ``lora`` at ``scale``)."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        out = np.empty(max_vocab, np.float32)
        n = self._lib.pe_llama_last_logits(
            str(model).encode(), None if lora is None else str(lora).encode(), scale,
            ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(ids), threads,
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), max_vocab,
        )  # fmt: skip
        if n < 0:
            raise LlamaCppError(self._lib.pe_llama_error().decode(errors="replace").strip())
        return out[:n].copy()


@dataclass(frozen=True)
class Agreement:
    """Last-position logits of one prompt: llama.cpp (``cpp``) against ours, base and
    fine-tuned (``ft``). ``max|.|`` over the vocabulary."""

    tokens: int
    effect_ours: float  # max|ours_ft - ours_base|: what the adapter changes
    effect_cpp: float  # max|cpp_ft - cpp_base|
    mismatch_base: float  # max|cpp_base - ours_base|: llama.cpp's arithmetic alone
    mismatch_ft: float  # max|cpp_ft - ours_ft|
    effect_error: float  # max|(cpp_ft - cpp_base) - (ours_ft - ours_base)|
    effect_error_rms: float  # RMS of that over RMS of ours_ft - ours_base
    top1_ft: tuple[int, int]  # ours, llama.cpp
    top5_overlap_ft: int
    top1_base: tuple[int, int]

    def summary(self) -> str:
        return (
            f"{self.tokens} tokens: adapter effect max|ours_ft - ours_base| = "
            f"{self.effect_ours:.3g} (llama.cpp: {self.effect_cpp:.3g}); "
            f"max|cpp_ft - ours_ft| = {self.mismatch_ft:.2g} "
            f"(base: {self.mismatch_base:.2g}); effect error max {self.effect_error:.2g}, "
            f"RMS {self.effect_error_rms:.2g} of the effect's; top-1 ours/cpp "
            f"{self.top1_ft[0]}/{self.top1_ft[1]} (base {self.top1_base[0]}/"
            f"{self.top1_base[1]}), top-5 overlap {self.top5_overlap_ft}/5"
        )


def _top(x: np.ndarray[Any, Any], k: int) -> list[int]:
    return [int(i) for i in np.argsort(-x, kind="stable")[:k]]


def agreement(
    cpp_base: np.ndarray[Any, Any],
    cpp_ft: np.ndarray[Any, Any],
    ours_base: np.ndarray[Any, Any],
    ours_ft: np.ndarray[Any, Any],
    tokens: int,
) -> Agreement:
    """How llama.cpp's logits (without and with the adapter) agree with ours."""
    d_ours, d_cpp = ours_ft - ours_base, cpp_ft - cpp_base
    rms = float(np.sqrt(np.mean((d_cpp - d_ours) ** 2)) / np.sqrt(np.mean(d_ours**2)))
    return Agreement(
        tokens=tokens,
        effect_ours=float(np.abs(d_ours).max()),
        effect_cpp=float(np.abs(d_cpp).max()),
        mismatch_base=float(np.abs(cpp_base - ours_base).max()),
        mismatch_ft=float(np.abs(cpp_ft - ours_ft).max()),
        effect_error=float(np.abs(d_cpp - d_ours).max()),
        effect_error_rms=rms,
        top1_ft=(_top(ours_ft, 1)[0], _top(cpp_ft, 1)[0]),
        top5_overlap_ft=len(set(_top(ours_ft, 5)) & set(_top(cpp_ft, 5))),
        top1_base=(_top(ours_base, 1)[0], _top(cpp_base, 1)[0]),
    )


def dequantized_gguf(source: Path, target: Path) -> Path:
    """``source`` with every tensor dequantized to float32 (metadata as it is): the same
    weights as our model reads, and llama.cpp's products on them are float32 products."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        value = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def torch_last_logits(model: Any, tokens: Sequence[int]) -> np.ndarray[Any, Any]:
    """A transformers causal LM's last-position logits of ``tokens``, float32."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(tokens)], dtype=torch.long)).logits
    return np.asarray(out[0, -1].float().numpy(), dtype=np.float32)


def load_gguf_model(gguf: Path) -> Any:
    """The GGUF file's model, dequantized to float32 by transformers (as our reader does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype="float32"
    )
    return model.eval()  # type: ignore[no-untyped-call]


def compare_run(
    run: Path,
    base: Path,
    prompt: str,
    *,
    chat: bool = False,
    float32: bool = False,
    threads: int = 1,
    version: str = VERSION,
) -> Agreement:
    """Export ``run``'s adapter (``--target gguf-lora``) and compare llama.cpp's logits on
    ``base`` (+ adapter) with PyTorch's on the same weights (``RUN/model``: merged).
    ``chat``: the prompt is a user turn in the run's chat template; ``float32``: llama.cpp
    runs on ``base`` dequantized to float32 (``dequantized_gguf``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pockengine.cli import main

    cpp = LlamaCpp(build(version))
    folder = run / "model"
    tok: Any = AutoTokenizer.from_pretrained(str(folder))
    if chat:
        turn = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(turn, add_generation_prompt=True, return_dict=True)
        tokens = list(ids["input_ids"])
    else:
        tokens = list(tok(prompt)["input_ids"])
    with tempfile.TemporaryDirectory() as tmp:
        if main(["export", str(run), "--target", "gguf-lora", "-o", f"{tmp}/out"]) != 0:
            raise SystemExit(f"export of {run} failed")
        adapter = Path(tmp) / "out" / "adapter.gguf"
        model = dequantized_gguf(base, Path(tmp) / "base-f32.gguf") if float32 else base
        cpp_base = cpp.last_logits(model, tokens, threads=threads)
        cpp_ft = cpp.last_logits(model, tokens, lora=adapter, threads=threads)
    ours_base = torch_last_logits(load_gguf_model(base), tokens)
    ft = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32")
    ft.eval()  # type: ignore[no-untyped-call]
    ours_ft = torch_last_logits(ft, tokens)
    return agreement(cpp_base, cpp_ft, ours_base, ours_ft, len(tokens))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama.cpp (cached) and print the library")
    b.add_argument("--version", default=VERSION, help="llama-cpp-python's version")
    c = sub.add_parser("compare", help="llama.cpp's logits with a run's adapter against ours")
    c.add_argument("run", type=Path)
    c.add_argument("--base", type=Path, help="the base GGUF (default: the run's --model)")
    c.add_argument("--prompt", default="What is 5 plus 3?")
    c.add_argument("--chat", action="store_true", help="the prompt as a user turn")
    c.add_argument("--float32", action="store_true", help="llama.cpp on the base dequantized")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--version", default=VERSION)
    c.add_argument("--json", type=Path, help="also write the figures, command and build here")
    args = parser.parse_args(argv)
    try:
        lib = build(args.version)
    except LlamaCppUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.command == "build":
        print(f"{lib}\n{json.dumps(build_info(args.version))}")
        return 0
    meta = json.loads((args.run / "model" / "pockengine.json").read_text())
    base = args.base or Path(meta["config"]["model"])
    result = compare_run(args.run, base, args.prompt, chat=args.chat, float32=args.float32,
                         threads=args.threads, version=args.version)  # fmt: skip
    print(result.summary())
    print(json.dumps(asdict(result)))
    if args.json is not None:
        command = "PYTHONPATH=$PWD python tools/llamacpp.py " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
        record = {"command": command, "build": build_info(args.version), **asdict(result)}
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
