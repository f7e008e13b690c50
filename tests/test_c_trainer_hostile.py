"""The stand-alone C trainer on hostile input, built with AddressSanitizer and UBSan.

One small exported step (token ids -> embedding -> linear -> cross-entropy with
``ignore_index=-100``) is built once with ``-fsanitize=address,undefined``; every case runs
``./train`` under it and must end with the intended exit status and message and no
sanitizer report (leaks included):

- index values: class targets out of range (past the classes, negative; the ignore_index
  passes), token ids past the vocabulary and at 10**6, a bad item deep in a stack;
- .npy files: truncated, trailing bytes, wrong dtype or shape, huge header lengths,
  Fortran order, bad magic, version or header dict, a shape whose size overflows;
- the state file: offsets outside it, a wrong dtype;
- options: negative, non-numeric, partly numeric and overflowing counts, unknown flags,
  missing values;
- ``--save``: a folder it cannot write refuses before the first step; a write that fails
  (a file size limit) leaves the previous state byte-identical and no temporary file.

Refused runs (exit 2) change no file in the folder; the trainer's own kernels are also
safe when called on out-of-range indices directly (``CBackend``).
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.backends.c import CBackend
from pockengine.backends.c.driver import KERNEL_DIR
from pockengine.backends.c.export import TRAINER_DIR, bounds_source, read_safetensors
from pockengine.ir import DType, GraphBuilder, Role, TensorType
from pockengine.plan.index_bounds import IndexBound
from pockengine.step.compiler import BatchError
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer"
ENV = {
    **os.environ,
    "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
VOCAB, CLASSES = 10, 3


def _model() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 4), torch.nn.Flatten(),
                                torch.nn.Linear(8, CLASSES))  # fmt: skip

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(ids), y)

    return model, loss_fn


IDS = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 0], [2, 3]], np.int64)
LABELS = np.array([0, 1, 2, 0, -100, 2], np.int64)  # one ignored target


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], dict[str, Array]]:
    """The exported folder built with sanitizers, and the in-process losses and state of
    two steps on (IDS, LABELS)."""
    model, loss_fn = _model()
    batch = (torch.from_numpy(IDS), torch.from_numpy(LABELS))
    step = pe.compile(model, loss_fn, batch, optimizer=pe.optim.SGD(lr=0.1))
    folder = step.export(tmp_path_factory.mktemp("hostile") / "trainer", target="c")
    np.save(folder / "ids.npy", IDS)
    np.save(folder / "y.npy", LABELS)
    make_trainer(folder, f"CFLAGS=-O0 -g {SANITIZE}", f"LDFLAGS={SANITIZE}")
    losses = [step(*batch), step(*batch)]
    return folder, losses, step.flat_state_dict()


def _train(folder: Path, *args: str, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def file_size_limit() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = subprocess.run(["./train", *args], cwd=folder, capture_output=True, text=True,
                         env=ENV, preexec_fn=file_size_limit)  # fmt: skip
    assert "Sanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr
    return run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _losses(stdout: str) -> list[float]:
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]


def test_a_normal_run_trains_as_in_process(trainer: Any) -> None:
    """The ignored target (-100) passes the check; losses and state as in process."""
    folder, losses, state = trainer
    run = _train(folder, "--steps", "2", "--save", "run.safetensors", "ids.npy", "y.npy")
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-6)
    saved = read_safetensors(folder / "run.safetensors")
    for name, value in state.items():
        np.testing.assert_allclose(saved[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert not list(folder.glob("*.tmp"))


def _with(array: Array, at: tuple[int, ...], value: int) -> Array:
    out = array.copy()
    out[at] = value
    return out


INDEX_CASES = [
    ("ids.npy", "bad.npy", _with(LABELS, (3,), 7),
     "bad.npy: class target 7 at flat position 3 is outside [0, 3) and is not the "
     "ignore_index -100; 1 value(s)"),
    ("ids.npy", "bad.npy", _with(LABELS, (1,), -1), "class target -1 at flat position 1"),
    ("ids.npy", "bad.npy", _with(LABELS, (0,), -101), "class target -101 at flat position 0"),
    ("bad.npy", "y.npy", _with(IDS, (4, 1), VOCAB),
     "bad.npy: token id 10 at flat position 9 (index [4, 1]) is outside [0, 10); 1 value(s)"),
    ("bad.npy", "y.npy", _with(IDS, (2, 0), 10**6), "token id 1000000 at flat position 4"),
    ("bad.npy", "y.npy", _with(IDS, (0, 0), -(2**63)), f"token id {-(2**63)} at flat position 0"),
    ("bad.npy", "y.npy", np.stack([IDS, IDS, _with(IDS, (5, 1), 11)]),
     "token id 11 at flat position 35 (index [2, 5, 1])"),
]  # fmt: skip


@pytest.mark.parametrize(("ids", "labels", "bad", "message"), INDEX_CASES)
def test_index_out_of_range_is_refused_before_the_step(
    trainer: Any, ids: str, labels: str, bad: Array, message: str
) -> None:
    folder, _, _ = trainer
    np.save(folder / "bad.npy", bad)
    shutil.copy(folder / "state.safetensors", folder / "prev.safetensors")
    before = _snapshot(folder)
    run = _train(folder, "--save", "prev.safetensors", ids, labels)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "nothing was trained" in run.stderr, run.stderr
    assert run.stdout == ""  # no step ran
    assert _snapshot(folder) == before  # the previous state and everything else as they were


def _npy_bytes(array: Array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _header(text: str, version: int = 1, length: int | None = None) -> bytes:
    body = text.encode("latin1")
    size = len(body) if length is None else length
    field = size.to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + field + body


GOOD = _npy_bytes(IDS)
DICT = "{'descr': '<i8', 'fortran_order': False, 'shape': (6, 2), }"
FILE_CASES = [
    ("truncated", GOOD[:-5], "holds 91 bytes of data where its header's dtype and shape need 96"),
    ("trailing bytes", GOOD + b"\0", "holds 97 bytes of data"),
    ("empty", b"", "not a .npy file"),
    ("bad magic", b"\x93NUMPZ" + GOOD[6:], "not a .npy file"),
    ("version 9", GOOD[:6] + b"\x09" + GOOD[7:], ".npy format version 9.0"),
    ("huge header, v1", GOOD[:8] + b"\xff\xff" + GOOD[10:], "ends inside its .npy header"),
    ("huge header, v2", _header("{}", 2, 2**31 - 1), "header length 2147483647 is over the limit"),
    ("header cut short", _header(DICT[:30]), "not a valid .npy header"),
    ("unknown key", _header(DICT.replace("'shape'", "'shap'")), "not a valid .npy header"),
    ("duplicate key", _header(DICT[:-1] + "'descr': '<f4', }"), "not a valid .npy header"),
    ("NUL in header", _header(DICT.replace(" }", "\0}")), "not a valid .npy header"),
    ("shape overflows", _header(DICT.replace("(6, 2)", "(99999999999999999999999, 2)")),
     "not a valid .npy header"),
    ("size overflows", _header(DICT.replace("(6, 2)", "(140737488355328, 140737488355328)")),
     "its header's shape is too large"),
    ("big-endian", _header(DICT.replace("<i8", ">i8")), "its dtype is not one the trainer reads"),
    ("object dtype", _header(DICT.replace("'<i8'", "'|O'")), "its dtype is not one"),
    ("fortran order", _npy_bytes(np.asfortranarray(np.zeros((6, 2), np.int64))),
     "in Fortran order"),
    ("wrong dtype", _npy_bytes(IDS.astype(np.float32)),
     "batch input 0 (batch.0) must be int64[6,2] or a stack [B, ...] of it (B >= 1), got "
     "float32[6,2]"),
    ("wrong shape", _npy_bytes(IDS[:3]), "got int64[3,2]"),
    ("empty stack", _npy_bytes(IDS[None][:0]), "got int64[0,6,2]"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "message"), [c[1:] for c in FILE_CASES],
                         ids=[c[0] for c in FILE_CASES])  # fmt: skip
def test_broken_npy_files_are_refused(trainer: Any, content: bytes, message: str) -> None:
    folder, _, _ = trainer
    (folder / "bad.npy").write_bytes(content)
    before = _snapshot(folder)
    run = _train(folder, "--save", "state.safetensors", "bad.npy", "y.npy")
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: bad.npy: ") and message in run.stderr, run.stderr
    assert run.stdout == "" and _snapshot(folder) == before


def _state_with(folder: Path, old: bytes, new: bytes) -> bytes:
    raw = (folder / "state.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + length].rstrip(b" ").replace(old, new, 1)
    header += b" " * (length - len(header))
    assert len(header) == length
    return raw[:8] + header + raw[8 + length :]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            b'"data_offsets":[0,160]',
            b'"data_offsets":[272,432]',
            'tensor "0.weight" has data offsets [272, 432]: not its 160 bytes inside the file',
        ),
        (b'"F32"', b'"F64"', 'tensor "0.weight" is not F32 of the step\'s shape'),
        (b'"shape":[10,4]', b'"shape":[4,10]', "is not F32 of the step's shape"),
        (b'"0.weight"', b'"0.weigh"', 'no tensor "0.weight"'),
    ],
)
def test_broken_state_files_are_refused(trainer: Any, old: bytes, new: bytes, message: str) -> None:
    folder, _, _ = trainer
    (folder / "bad.safetensors").write_bytes(_state_with(folder, old, new))
    run = _train(folder, "--state", "bad.safetensors", "ids.npy", "y.npy")
    assert run.returncode == 2 and run.stderr.startswith("error: bad.safetensors: "), run.stderr
    assert message in run.stderr and run.stdout == ""
    (folder / "cut.safetensors").write_bytes((folder / "state.safetensors").read_bytes()[:100])
    run = _train(folder, "--state", "cut.safetensors", "ids.npy", "y.npy")
    assert run.returncode == 2 and "cut.safetensors: not a safetensors file" in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-1"], "--steps takes a non-negative integer, got '-1'"),
        (["--steps", "abc"], "--steps takes a non-negative integer, got 'abc'"),
        (["--steps", "1x"], "--steps takes a non-negative integer, got '1x'"),
        (["--steps", " 1"], "--steps takes a non-negative integer, got ' 1'"),
        (["--steps", "+1"], "--steps takes a non-negative integer, got '+1'"),
        (["--steps", "9" * 30], f"--steps takes a non-negative integer, got '{'9' * 30}'"),
        (
            ["--threads", "5000"],
            "--threads takes a non-negative integer (at most 4096), got '5000'",
        ),
        (["--bogus"], "unknown option '--bogus'"),
        (["-s"], "unknown option '-s'"),
        (["--steps=3"], "unknown option '--steps=3'"),
        (["--steps"], "--steps needs a value"),
        (["--save", "--steps", "1"], "--save needs a value"),
        (["--state", ""], "--state needs a value"),
    ],
)
def test_options_are_parsed_strictly(trainer: Any, args: list[str], message: str) -> None:
    folder, _, _ = trainer
    before = _snapshot(folder)
    run = _train(folder, "--save", "state.safetensors", "ids.npy", "y.npy", *args)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 2, run.stderr
    assert lines[0] == f"error: {message}"
    assert lines[1].startswith("usage: ./train ")
    assert run.stdout == "" and _snapshot(folder) == before


def test_help_prints_the_usage(trainer: Any) -> None:
    folder, _, _ = trainer
    before = _snapshot(folder)
    run = _train(folder, "--steps", "1", "--help", "ids.npy")
    assert run.returncode == 0 and run.stdout.startswith("usage: ./train [--steps N]")
    assert run.stderr == "" and _snapshot(folder) == before


def test_save_into_a_folder_it_cannot_write_fails_before_the_first_step(trainer: Any) -> None:
    folder, _, _ = trainer
    before = _snapshot(folder)
    run = _train(folder, "--save", "missing/out.safetensors", "ids.npy", "y.npy")
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert "missing/out.safetensors.tmp: cannot write the state there" in run.stderr
    run = _train(folder, "--save", "kernels", "ids.npy", "y.npy")
    assert run.returncode == 2 and "kernels: is a folder" in run.stderr and run.stdout == ""
    assert _snapshot(folder) == before


def test_a_failed_save_keeps_the_previous_state(trainer: Any) -> None:
    """A file size limit below the state's size makes the write fail (EFBIG, as on a full
    disk): exit 1, the previous file byte-identical, no temporary file left."""
    folder, losses, _ = trainer
    previous = folder / "previous.safetensors"
    shutil.copy(folder / "state.safetensors", previous)
    size = previous.stat().st_size
    before = _snapshot(folder)
    run = _train(folder, "--save", "previous.safetensors", "ids.npy", "y.npy", limit=size // 2)
    assert run.returncode == 1, run.stderr
    assert _losses(run.stdout) == pytest.approx(losses[:1], rel=1e-6)  # the step did run
    assert (
        "previous.safetensors.tmp: write failed (File too large); previous.safetensors is unchanged"
    ) in run.stderr, run.stderr
    assert _snapshot(folder) == before
    run = _train(folder, "--save", "previous.safetensors", "ids.npy", "y.npy")
    assert run.returncode == 0 and previous.read_bytes() != before["previous.safetensors"]
    assert previous.stat().st_size == size and not list(folder.glob("*.tmp"))


_PROBE = r"""#include <stdio.h>
#include "pe_check.h"
int main(void) {
    for (int i = 0; i < pe_num_index_bounds; i++) {
        const pe_index_bound *b = &pe_index_bounds[i];
        printf("%d|%s|%lld|%s", b->input, b->name, (long long)b->high, b->what);
        for (int k = 0; k < b->num_ignored; k++) printf("|%lld", (long long)b->ignored[k]);
        printf("\n");
    }
    return 0;
}
"""


def test_bounds_table_compiles_for_any_input_names(tmp_path: Path) -> None:
    """``bounds.c`` for no bounds, and for non-ASCII names and extreme ignore_index
    values (int64's most negative; one past int64, which no batch value can equal): it
    compiles and holds the names byte for byte."""
    b = GraphBuilder("g")
    names = ["y", "ids\u00e9\u4e2d"]
    for name in names:
        b.input(name, TensorType((4,), DType.I64), Role.INPUT)
    graph = b.build([])
    bounds = [IndexBound(names[0], 3, frozenset({-100, -(2**63), 2**70}), "class target"),
              IndexBound(names[1], 7, frozenset(), "token id")]  # fmt: skip
    (tmp_path / "probe.c").write_text(_PROBE)
    for label, table in (("none", []), ("some", bounds)):
        source = tmp_path / f"bounds_{label}.c"
        source.write_text(bounds_source(graph, table))
        exe = tmp_path / f"probe_{label}"
        subprocess.run([os.environ.get("CC") or "cc", "-std=c11", "-Wall", "-Werror",
                        f"-I{TRAINER_DIR}", f"-I{KERNEL_DIR}", str(source),
                        str(tmp_path / "probe.c"), "-o", str(exe)], check=True)  # fmt: skip
        out = subprocess.run([str(exe)], capture_output=True, check=True).stdout.decode()
        want = [] if label == "none" else [
            f"0|{names[0]}|3|class target|{-(2**63)}|-100", f"1|{names[1]}|7|token id"
        ]  # fmt: skip
        assert out.splitlines() == want


def test_readme_lists_the_index_ranges(trainer: Any) -> None:
    text = (trainer[0] / "README.md").read_text()
    assert "- `batch.0` (token ids): in [0, 10)" in text
    assert "- `batch.1` (class targets): in [0, 3), or the ignore_index -100" in text
    assert "Exit status: 0 done; 2 refused" in text


# -- the kernels themselves, called directly --------------------------------------------


def test_c_kernels_never_index_outside_a_tensor() -> None:
    """Out-of-range ids and gather indices (as a caller bypassing the step's batch check
    could pass, or a batch input used as an ``x[ids]`` index, which no batch check
    covers): a lookup gives zeros, a scatter-add skips them."""
    b = GraphBuilder("g")
    table = b.input("table", TensorType((4, 3), DType.F32), Role.PARAM)
    ids = b.input("ids", TensorType((5,), DType.I64), Role.INPUT)
    gz = b.input("gz", TensorType((5, 3), DType.F32), Role.INPUT)
    x = b.input("x", TensorType((5, 4), DType.F32), Role.INPUT)
    index = b.input("index", TensorType((5, 1), DType.I64), Role.INPUT)
    gg = b.input("gg", TensorType((5, 1), DType.F32), Role.INPUT)
    outputs = [
        b.call("embedding", table, ids, padding_idx=None),
        b.call("embedding_grad", gz, ids, num_rows=4, padding_idx=None),
        b.call("gather", x, index, axis=1),
        b.call("gather_grad", gg, index, axis=1, shape=(5, 4)),
        b.call("index", table, ids, axes=(0,)),
        b.call("index_grad", gz, ids, axes=(0,), shape=(4, 3)),
    ]
    executable = CBackend().compile(b.build(outputs))
    tables = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
    bad = np.array([1, 4, -1, 10**6, 3], np.int64)
    feeds = {"ids": bad, "gz": np.ones((5, 3), np.float32), "x": np.ones((5, 4), np.float32),
             "index": bad[:, None], "gg": np.ones((5, 1), np.float32)}  # fmt: skip
    looked, grad, gathered, scattered, indexed, index_grad = executable.run(
        {"table": tables}, feeds
    )
    ok = np.array([True, False, False, False, True])
    np.testing.assert_array_equal(looked[ok], tables[[1, 3]])
    assert not looked[~ok].any()
    np.testing.assert_array_equal(grad.sum(axis=1), [0, 3, 0, 3])
    wraps = np.array([True, False, True, False, True])  # x[-1] is the last row, as in NumPy
    np.testing.assert_array_equal(indexed[wraps], tables[[1, 3, 3]])
    assert not indexed[~wraps].any()
    np.testing.assert_array_equal(index_grad.sum(axis=1), [0, 3, 0, 6])
    np.testing.assert_array_equal(gathered[:, 0], np.where(ok, 1, 0))
    np.testing.assert_array_equal(scattered.sum(axis=1), ok.astype(np.float32))


@pytest.mark.parametrize("where", ["ids", "labels"])
def test_the_in_process_c_step_refuses_out_of_range_batches(where: str) -> None:
    model, loss_fn = _model()
    batch = (torch.from_numpy(IDS), torch.from_numpy(LABELS))
    step = pe.compile(model, loss_fn, batch, backend="c")
    before = step.flat_state_dict()
    bad = (_with(IDS, (0, 1), 10**6), LABELS) if where == "ids" else (IDS, _with(LABELS, (2,), 3))
    with pytest.raises(BatchError, match="out of range"):
        step(*(torch.from_numpy(a) for a in bad))
    for name, value in step.flat_state_dict().items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"x" * 5000, "line longer than"),
        (b"", "empty (expected the line"),
        (b"\xff\xfe\x00garbage\n", "not text (a NUL byte)"),
        (b"\xff\xfegarbage\n", "not a shape table of this step"),
        (b"{header}\n99999999999999999999999 4x8 0 a\n", "expected '<slot>"),
        (b"{header}\n0 4x8 1e999 a\n", "outside this step's"),
        (b"{header}\n" + b"0 " + b"9" * 400 + b"x4 0 a\n", "outside this step's"),
    ],
)
def test_hostile_shape_tables_are_refused(trainer: Any, content: bytes, message: str) -> None:
    """Under the sanitizers: a GEMM shape table that is too long, empty, binary, or names
    slots this step does not have is refused (exit 2) before anything runs or is written."""
    folder, _, _ = trainer
    tuned = _train(folder, "--tune", "--kernels", "k.txt", "--shapes", "s.txt",
                   "--layouts", "l.txt")  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    header = (folder / "s.txt").read_text().splitlines()[0].encode()
    (folder / "bad-shapes.txt").write_bytes(content.replace(b"{header}", header))
    before = _snapshot(folder)
    run = _train(folder, "--shapes", "bad-shapes.txt", "--save", "state.safetensors",
                 "ids.npy", "y.npy")  # fmt: skip
    assert run.returncode == 2 and "bad-shapes.txt" in run.stderr and message in run.stderr
    assert run.stdout == "" and _snapshot(folder) == before
    for name in ("k.txt", "s.txt", "l.txt", "bad-shapes.txt"):
        (folder / name).unlink(missing_ok=True)
