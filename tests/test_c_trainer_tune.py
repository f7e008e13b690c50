"""``./train --tune``: the exported trainer times each convolution's candidate kernels on
the device, writes its kernel table, then times each GEMM node under the GEMM's
micro-kernel shapes and writes its shape table; later runs read both (checked line by
line: a slot, kernel, shape or fingerprint that does not fit this step is refused before
anything runs). A tiny CNN (dense, depthwise and pointwise convolutions, each with both
gradients) exported, built, tuned and trained end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c.conv_kernels import KERNEL_NAMES, candidates, conv_geometry
from pockengine.backends.c.conv_table import TABLE_FILE, conv_slots
from pockengine.backends.c.gemm_table import SHAPE_FILE, gemm_slots
from tests.cached_cc import make_trainer

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None or shutil.which("make") is None,
    reason="no C compiler (cc or $CC) or make",
)


def _built(w: zoo.Workload, opt: Any, folder: Path) -> tuple[Path, list[float], Any]:
    """``w``'s C step exported to ``folder`` and built, with 3 batches as X.npy and Y.npy;
    the folder, the in-process losses on them and the step."""
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=opt, backend="c")
    folder = step.export(folder, target="c")
    batches = [w.make_batch(i) for i in range(3)]
    np.save(folder / "X.npy", np.stack([b[0].numpy() for b in batches]))
    np.save(folder / "Y.npy", np.stack([b[1].numpy() for b in batches]))
    losses = [step(*b) for b in batches]
    make_trainer(folder)
    return folder, losses, step


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], dict[str, int]]:
    """The exported, built trainer of a small CNN with 3 batches, the in-process losses
    and the step's conv slots."""
    opt = pe.optim.SGD(lr=0.05, momentum=0.9)
    folder, losses, step = _built(zoo.small_cnn(), opt, tmp_path_factory.mktemp("tune") / "trainer")
    return folder, losses, conv_slots(step._exec.graph)


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["./train", *args], cwd=folder, capture_output=True, text=True)


def _losses(stdout: str) -> list[float]:
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]


def test_tune_writes_a_table_that_the_next_run_reads(
    trainer: tuple[Path, list[float], dict[str, int]],
) -> None:
    folder, losses, slots = trainer
    (folder / TABLE_FILE).unlink(missing_ok=True)
    assert slots and "switch (pe_conv_choice[" in (folder / "step.c").read_text()
    plain = _run(folder, "X.npy", "Y.npy")
    assert plain.returncode == 0 and "conv kernels" not in plain.stderr, plain.stderr
    tuned = _run(folder, "--tune")
    assert tuned.returncode == 0, tuned.stderr
    lines = (folder / TABLE_FILE).read_text().splitlines()
    assert lines[0].startswith("pockengine-conv-kernels 1 ") and len(lines) == len(slots) + 1
    for slot, line in enumerate(lines[1:]):
        k, kernel, seconds, name = line.split()
        assert int(k) == slot and slots[name] == slot and float(seconds) >= 0
        assert kernel in KERNEL_NAMES
    report = tuned.stdout.splitlines()  # a line a slot, a GEMM slot, a layout candidate
    assert len([x for x in report if not x.startswith(("layout ", "gemm "))]) == len(slots)
    layouts = (folder / "conv-layouts.txt").read_text().splitlines()
    assert len(layouts) - 1 == len([x for x in report if x.startswith("layout ")]) > 0
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 0 and f"conv kernels: {TABLE_FILE}" in run.stderr, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-4)


def test_a_run_follows_the_table(trainer: tuple[Path, list[float], dict[str, int]]) -> None:
    """Every slot forced onto direct loops by a hand-written table: the same losses, and
    a table that names a kernel a slot cannot run is refused (exit 2, file and line)."""
    folder, losses, slots = trainer
    _run(folder, "--tune")
    head = (folder / TABLE_FILE).read_text().splitlines()[0]
    table = [head, *(f"{k} direct 0 {name}" for name, k in slots.items())]
    (folder / TABLE_FILE).write_text("\n".join(table) + "\n")
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("99999 direct 0 x", "outside this step's"),
        ("-1 direct 0 x", "expected '<slot>"),
        ("0 pointwise 0 x", "cannot compute slot 0"),
        ("0 fft 0 x", "cannot compute slot 0"),
        ("0 direct nan x", "time in seconds"),
        ("0 direct -1 x", "time in seconds"),
        ("0 direct", "time in seconds"),
        ("0 direct 1e-3x x", "time in seconds"),
        ("0 " + "d" * 64 + " 1e-3 x", "time in seconds"),  # a word past the 63 bytes read
        ("garbage", "expected '<slot>"),
    ],
)
def test_a_bad_table_is_refused_with_its_line(
    trainer: tuple[Path, list[float], dict[str, int]], line: str, message: str
) -> None:
    folder, _, _ = trainer
    _run(folder, "--tune")
    lines = (folder / TABLE_FILE).read_text().splitlines()
    (folder / TABLE_FILE).write_text("\n".join([*lines[:2], line]) + "\n")
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 2 and f"{TABLE_FILE}:3: " in run.stderr and message in run.stderr
    assert "step 0" not in run.stdout


def test_a_table_of_another_step_or_a_repeated_slot_is_refused(
    trainer: tuple[Path, list[float], dict[str, int]],
) -> None:
    folder, _, _ = trainer
    _run(folder, "--tune")
    lines = (folder / TABLE_FILE).read_text().splitlines()
    (folder / TABLE_FILE).write_text("\n".join(["pockengine-conv-kernels 1 0000", *lines[1:]]))
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 2 and f"{TABLE_FILE}:1: not a kernel table of this step" in run.stderr
    (folder / TABLE_FILE).write_text("\n".join([*lines, lines[1]]) + "\n")
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 2 and "appears twice" in run.stderr, run.stderr
    run = _run(folder, "--tune", "X.npy")
    assert run.returncode == 2 and "--tune takes only" in run.stderr


def _shapes(folder: Path) -> tuple[list[str], list[str]]:
    """After ``--tune``: the shape table's lines, and the build's shapes (the report's)."""
    tuned = _run(folder, "--tune")
    assert tuned.returncode == 0, tuned.stderr
    report = [x for x in tuned.stdout.splitlines() if x.startswith("gemm ")]
    timed = next(x for x in report if " ms" in x).split("->")[0].split()
    labels = [word for word in timed if "x" in word and word.replace("x", "").isdigit()]
    return (folder / SHAPE_FILE).read_text().splitlines(), labels


def test_tune_writes_a_shape_table_and_every_shape_trains_the_same_bits(
    trainer: tuple[Path, list[float], dict[str, int]],
) -> None:
    """One line a GEMM slot, each naming one of the build's three shapes; a hand-written
    table putting every slot on each shape in turn gives the untuned run's losses, to the
    last printed digit (every shape sums each element's products in the same order)."""
    folder, _, _ = trainer
    (folder / TABLE_FILE).unlink(missing_ok=True)
    (folder / SHAPE_FILE).unlink(missing_ok=True)
    assert "pe_gemm_shape = pe_gemm_choice[" in (folder / "step.c").read_text()
    plain = _run(folder, "X.npy", "Y.npy")
    assert plain.returncode == 0 and "GEMM shapes" not in plain.stderr, plain.stderr
    lines, labels = _shapes(folder)
    assert len(labels) == 3 and len(set(labels)) == 3
    assert lines[0].startswith("pockengine-gemm-shapes 1 ") and len(lines) > 1
    for slot, line in enumerate(lines[1:]):
        k, shape, seconds, _ = line.split()
        assert int(k) == slot and shape in labels and float(seconds) >= 0
    (folder / TABLE_FILE).unlink()
    for label in labels:
        table = [lines[0], *(f"{k} {label} 0 node" for k in range(len(lines) - 1))]
        (folder / SHAPE_FILE).write_text("\n".join(table) + "\n")
        run = _run(folder, "X.npy", "Y.npy")
        assert run.returncode == 0 and f"GEMM shapes: {SHAPE_FILE}" in run.stderr, run.stderr
        assert run.stdout == plain.stdout


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("99999 {shape} 0 x", "outside this step's"),
        ("-1 {shape} 0 x", "expected '<slot>"),
        ("0 99x99 0 x", "is not one of this build's for slot 0"),
        ("0 {shape} nan x", "time in seconds"),
        ("0 {shape} -1 x", "time in seconds"),
        ("0 {shape} 0 x\n0 {shape} 0 x", "appears twice"),
        ("garbage", "expected '<slot>"),
    ],
)
def test_a_bad_shape_table_is_refused_with_its_line(
    trainer: tuple[Path, list[float], dict[str, int]], line: str, message: str
) -> None:
    folder, _, _ = trainer
    lines, labels = _shapes(folder)
    bad = line.format(shape=labels[1])
    (folder / SHAPE_FILE).write_text("\n".join([lines[0], bad]) + "\n")
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 2 and f"{SHAPE_FILE}:" in run.stderr and message in run.stderr
    assert "step 0" not in run.stdout
    (folder / SHAPE_FILE).write_text("\n".join(["pockengine-gemm-shapes 1 0000", *lines[1:]]))
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 2 and f"{SHAPE_FILE}:1: not a shape table of this step" in run.stderr
    other = folder / "other-shapes.txt"
    other.write_text("\n".join([lines[0], bad]) + "\n")
    run = _run(folder, "--shapes", "other-shapes.txt", "X.npy", "Y.npy")
    assert run.returncode == 2 and "other-shapes.txt:" in run.stderr
    (folder / SHAPE_FILE).unlink()


def test_a_folder_given_as_a_table_is_refused_as_a_folder(
    trainer: tuple[Path, list[float], dict[str, int]],
) -> None:
    folder, _, _ = trainer
    (folder / "tables").mkdir(exist_ok=True)
    (folder / "pipe").unlink(missing_ok=True)
    os.mkfifo(folder / "pipe")  # opening it to read would wait for a writer
    for flag in ("--shapes", "--kernels"):
        run = _run(folder, flag, "tables", "X.npy", "Y.npy")
        assert run.returncode == 2, run.stderr
        assert "tables: is a folder, not a file" in run.stderr and "step 0" not in run.stdout
        run = subprocess.run(["./train", flag, "pipe", "X.npy", "Y.npy"], cwd=folder,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 2 and "pipe: is not a regular file" in run.stderr, run.stderr


def test_gemm_slots_are_the_products_and_gemm_convolutions() -> None:
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.1),
                      backend="c")  # fmt: skip
    graph = step._exec.graph
    slots = gemm_slots(graph)
    assert list(slots.values()) == list(range(len(slots))) and slots
    ops = {n.outputs[0].name: n for n in graph.nodes if n.outputs}
    for name in slots:
        node = ops[name]
        if node.op not in ("matmul", "linear"):
            kernels = set(candidates(node.op, conv_geometry(node)))
            assert kernels & {"pointwise", "im2col"}


def test_slots_cover_every_conv_node_with_a_choice() -> None:
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.1),
                      backend="c")  # fmt: skip
    graph = step._exec.graph
    slots = conv_slots(graph)
    convs = [n for n in graph.nodes if n.op.startswith("conv2d")]
    multi = [n.outputs[0].name for n in convs if len(candidates(n.op, conv_geometry(n))) > 1]
    assert list(slots) == multi and list(slots.values()) == list(range(len(multi)))


def test_a_float_trainer_names_no_double_kernel_and_links_no_scanf(
    trainer: tuple[Path, list[float], dict[str, int]],
) -> None:
    """Its timing harness has cases for float only, so a static build (``STATIC=1``: unused
    code dropped) carries no double kernels; the tables are read without scanf."""
    folder, _, _ = trainer
    convs = (folder / "convs.c").read_text()
    assert "_f32(" in convs and "_f64" not in convs
    assert "case 0: return pe_gemm_shape_list_f32" in convs
    undefined = subprocess.run(["nm", "-u", "train"], cwd=folder, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert "printf" in undefined and "scanf" not in undefined


def test_a_double_trainer_tunes_and_trains_as_the_step(tmp_path: Path) -> None:
    """float64: its harness times the double kernels and shapes; the tables it writes are
    read back and the run trains as the in-process step."""
    w = zoo.as_double(zoo.small_cnn())
    folder, losses, _ = _built(w, pe.optim.SGD(lr=0.05), tmp_path / "trainer")
    convs = (folder / "convs.c").read_text()
    assert "_f64(" in convs and "_f32(" not in convs
    tuned = _run(folder, "--tune")
    assert tuned.returncode == 0, tuned.stderr
    for table in (SHAPE_FILE, TABLE_FILE):  # a slot whose kernel runs no GEMM: no time
        times = [float(x.split()[2]) for x in (folder / table).read_text().splitlines()[1:]]
        assert times and min(times) >= 0 and max(times) > 0, table
    run = _run(folder, "X.npy", "Y.npy")
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-8)
