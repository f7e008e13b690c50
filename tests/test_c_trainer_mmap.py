"""The stand-alone trainer maps its frozen tensors read-only (``frozen.bin``).

A zoo LLaMA with LoRA on q/v, its frozen weights int4 groups or GGUF blocks (Q8_0 tied
embedding, Q4_0 attention, Q4_1 MLP), is exported and built with AddressSanitizer and
UBSan:

- ``state.safetensors`` holds only the trained tensors, buffers and optimizer state, and
  ``frozen.bin`` every frozen tensor at a 64-byte aligned offset;
- ``./train`` maps ``frozen.bin`` ``PROT_READ``: 5 steps give the losses of the in-process
  C step (which holds its weights in memory) and of the torch backend, so the step wrote
  no frozen tensor (a write would be a SIGSEGV); ``--save`` writes and ``--state`` reads
  the trained state only; ``--memory-report`` splits the peak into anonymous and file
  pages, the whole frozen file among the latter;
- a truncated or lengthened file, a tensor's offset past the end or off the 64-byte grid,
  an altered dtype or shape, a byte of a tensor changed (the exported digest of the
  tensors' bytes), and a symbolic link to a copy outside the folder are each
  refused with one ``error:`` line naming the file (and the tensor), exit status 2, no
  sanitizer report.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c.export import read_safetensors, read_trainer_state
from pockengine.frontend.import_memo import reused_imports
from pockengine.tasks.gguf import decode_blocks
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler"),
]
SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer"
ENV = {
    **os.environ,
    "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
STEPS = 5
_KINDS = {"embed_tokens": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0",
          "o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q4_1",
          "down_proj": "Q4_0"}  # fmt: skip


def _gguf_blocks(model: Any) -> dict[str, Any]:
    from gguf import GGMLQuantizationType, quants

    out = {}
    for name, p in model.named_parameters():
        kind = next((k for end, k in _KINDS.items() if f"{end}.weight" in name), None)
        if kind is not None:
            w = p.detach().numpy().astype(np.float32)
            blocks = quants.quantize(w, GGMLQuantizationType[kind])
            out[name] = decode_blocks(blocks, kind, w.shape)
    return out


@dataclass
class _Case:
    folder: Path
    trained: tuple[str, ...]  # the model names of the trained params
    losses: dict[str, list[float]]  # in-process "c" and "torch"


def _export(kind: str, tmp: Path) -> _Case:
    w = zoo.llama_lm(layers=1, tied=True, vocab=4096)
    lora = pe.schemes.lora(rank=4, alpha=8, targets=["*q_proj", "*v_proj"])
    kw: dict[str, Any] = {"scheme": lora}
    kw.update({"frozen_dtype": "int4"} if kind == "int4" else {"quantized": _gguf_blocks(w.model)})
    batch = w.make_batch(0)
    with reused_imports():  # one torch.export for both backends
        steps = {b: pe.compile(w.model, w.loss_fn, batch, backend=b,
                               optimizer=pe.optim.AdamW(lr=1e-2), **kw)
                 for b in ("c", "torch")}  # fmt: skip
    folder = steps["c"].export(tmp / kind, target="c")
    batches = [w.make_batch(i)[0].numpy() for i in range(STEPS)]
    np.save(folder / "ids.npy", np.stack(batches))
    losses = {b: [s(x) for x in batches] for b, s in steps.items()}
    make_trainer(folder, f"CFLAGS=-O1 -g {SANITIZE}", f"LDFLAGS={SANITIZE}")
    return _Case(folder, tuple(steps["c"].trained), losses)


@pytest.fixture(scope="module", params=["int4", "gguf"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Case:
    return _export(request.param, tmp_path_factory.mktemp("mmap"))


def _train(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["./train", *args], cwd=folder, capture_output=True, text=True,
                         env=ENV)  # fmt: skip
    assert "Sanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr
    return run


def _losses(stdout: str) -> list[float]:
    return [float(ln.split()[-1]) for ln in stdout.splitlines() if ln.startswith("step ")]


def test_state_file_holds_only_what_the_step_writes(case: _Case) -> None:
    state = read_safetensors(case.folder / "state.safetensors")
    frozen = read_safetensors(case.folder / "frozen.bin")
    assert set(case.trained) <= set(state) and not set(state) & set(frozen)
    assert all(a.dtype.kind == "f" and a.dtype.itemsize == 4 for a in state.values())
    assert any(a.dtype in (np.uint8, np.int8) for a in frozen.values())
    assert any("q_proj.weight" in n for n in frozen)
    raw = (case.folder / "frozen.bin").read_bytes()
    header = int.from_bytes(raw[:8], "little")
    assert (8 + header) % 64 == 0
    import json

    entries = json.loads(raw[8 : 8 + header])
    assert all(e["data_offsets"][0] % 64 == 0 for n, e in entries.items() if n != "__metadata__")
    assert set(read_trainer_state(case.folder)) == set(state) | set(frozen)


def test_mapped_trainer_gives_the_in_memory_losses(case: _Case) -> None:
    run = _train(case.folder, "--steps", str(STEPS), "--save", "out.safetensors",
                 "--memory-report", "ids.npy")  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = re.search(r"memory MiB: peak ([\d.]+) rss [\d.]+ anon ([\d.]+) file ([\d.]+) \| "
                       r"arena [\d.]+ state ([\d.]+) mapped ([\d.]+)", run.stderr)  # fmt: skip
    assert report, run.stderr
    peak, anon, file, state, mapped = (float(x) for x in report.groups())
    assert mapped == pytest.approx((case.folder / "frozen.bin").stat().st_size / 2**20, abs=0.06)
    assert file >= mapped - 0.1 and peak >= anon > state >= 0
    got = _losses(run.stdout)
    np.testing.assert_allclose(got, case.losses["c"], rtol=1e-6)
    np.testing.assert_allclose(got, case.losses["torch"], rtol=1e-5)
    saved = read_safetensors(case.folder / "out.safetensors")
    assert set(saved) == set(read_safetensors(case.folder / "state.safetensors"))
    # --state reads the trained state only: resuming from the save continues the run
    resumed = _train(case.folder, "--steps", "1", "--state", "out.safetensors", "ids.npy")
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(resumed.stdout)[0] != pytest.approx(got[0], rel=1e-6)


def _header(raw: bytes) -> tuple[int, str]:
    n = int.from_bytes(raw[:8], "little")
    return n, raw[8 : 8 + n].decode()


def _rewrite(raw: bytes, old: str, new: str) -> bytes:
    """``raw`` with ``old`` replaced by ``new`` in its header, the header's length kept
    (the padding after the JSON grows or shrinks)."""
    n, text = _header(raw)
    assert old in text
    text = text.replace(old, new, 1).rstrip(" ")
    assert len(text) <= n
    return raw[:8] + text.ljust(n).encode() + raw[8 + n :]


def _hostile(raw: bytes, name: str) -> dict[str, tuple[bytes, str]]:
    """Altered frozen files and a piece of the message each must give; the offsets of the
    last tensor move, ``name``'s dtype and shape change."""
    import json

    entries = json.loads(_header(raw)[1])
    entry = entries[name]
    last = max((n for n in entries if n != "__metadata__"),
               key=lambda n: entries[n]["data_offsets"][0])  # fmt: skip
    lo, hi = entries[last]["data_offsets"]
    offsets = f'"data_offsets":[{lo},{hi}]'
    dtype = f'"dtype":"{entry["dtype"]}"'
    other = "I8" if entry["dtype"] == "U8" else "U8"
    shape = ",".join(map(str, entry["shape"]))
    reversed_shape = ",".join(map(str, entry["shape"][::-1]))
    return {
        "truncated": (raw[: len(raw) // 2], "bytes where this step was exported with"),
        "lengthened": (raw + b"\0" * 64, "bytes where this step was exported with"),
        "past the end": (
            _rewrite(raw, offsets, f'"data_offsets":[{lo + len(raw)},{hi + len(raw)}]'),
            last,
        ),
        "misaligned": (
            _rewrite(raw, offsets, f'"data_offsets":[{lo - 1},{hi - 1}]'),
            "not a multiple of 64",
        ),
        "dtype": (_rewrite(raw, dtype, f'"dtype":"{other}"'), name),
        "shape": (_rewrite(raw, f'"shape":[{shape}]', f'"shape":[{reversed_shape}]'), name),
        "garbage": (b"\xff" * len(raw), "not a safetensors file"),
        "one byte changed": (_flip(raw, 8 + _header(raw)[0] + hi - 1), "differ from the exported"),
        "first byte changed": (_flip(raw, 8 + _header(raw)[0] + lo), "differ from the exported"),
    }


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x5A]) + raw[at + 1 :]


def test_hostile_frozen_files_are_refused(case: _Case, tmp_path: Path) -> None:
    path = case.folder / "frozen.bin"
    raw = path.read_bytes()
    frozen = read_safetensors(path)
    name = next(n for n, a in frozen.items() if a.ndim == 2 and a.shape[0] != a.shape[1])
    try:
        for label, (data, message) in _hostile(raw, name).items():
            path.write_bytes(data)
            run = _train(case.folder, "--steps", "1", "ids.npy")
            lines = run.stderr.strip().splitlines()
            assert run.returncode == 2, (label, run.stderr)
            assert len(lines) == 1 and lines[0].startswith("error: frozen.bin"), (label, lines)
            assert message in lines[0], (label, lines[0])
            assert run.stdout == "", label
        outside = tmp_path / "elsewhere.bin"
        outside.write_bytes(raw)
        path.unlink()
        path.symlink_to(outside)
        run = _train(case.folder, "--steps", "1", "ids.npy")
        assert run.returncode == 2 and "symbolic link" in run.stderr, run.stderr
        path.unlink()
        run = _train(case.folder, "--steps", "1", "ids.npy")
        assert run.returncode == 2 and "frozen.bin: cannot open" in run.stderr, run.stderr
    finally:
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_bytes(raw)
    assert _train(case.folder, "--steps", "1", "ids.npy").returncode == 0
