"""Layouts measured on the device: ``./train --tune`` of an exported trainer times every
convolution that has an NHWC kernel against NHWC (and the depthwise ones against
NCHW{c}c) and writes ``conv-layouts.txt``; an export of the same step with that file
(``step.export(..., layouts=...)``, ``pockengine export --layouts``) takes its layouts
(``backends/c/layout_table.py``).

- MobileNetV2 (width 0.35, 32 px, batch 2): the trainer's file names each candidate once
  under this step's fingerprint, with an NCHW{c}c time exactly for the depthwise ones; an
  export with every candidate in NHWC (or every depthwise one in NCHW8c, the rest NHWC)
  runs them all on those kernels and ./train trains as the in-process (NCHW) step does
  (float64); with every one in NCHW none.
- A file of another step, an unknown or repeated node, another layout word, NCHW{c}c for a
  node without that kernel, a bad time, a missing node, a file that is not text: one
  error naming the file and line, and no folder is written.
"""

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
from pockengine.backends.c.layout_table import LAYOUT_FILE, LayoutFileError
from pockengine.cli import main
from tests.cached_cc import make_trainer
from tests.trainer_losses import trainer_losses

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                       reason="no C compiler (cc or $CC)"),
    pytest.mark.skipif(shutil.which("make") is None, reason="no make"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """The step, its workload and the layout file its trainer's ./train --tune wrote."""
    w = zoo.mobilenet_v2(width=0.35, batch=2, size=32, classes=10)
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), pe.optim.SGD(lr=0.01), backend="c")
    folder = step.export(tmp_path_factory.mktemp("tuned") / "trainer", target="c")
    make_trainer(folder)
    run = subprocess.run(["./train", "--tune"], cwd=folder, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"wrote {LAYOUT_FILE}" in run.stderr and "layout conv2d" in run.stdout
    return step, w, folder / LAYOUT_FILE


def _with(path: Path, lines: list[str], out: Path) -> Path:
    out.write_text("\n".join(lines) + "\n")
    return out


def _lines(tuned: tuple[Any, Any, Path]) -> list[str]:
    return tuned[2].read_text().splitlines()


def _blocked_names(step: Any) -> set[str]:
    """The step's layout candidates that have an NCHW{c}c kernel."""
    from pockengine.backends.c.layout import layout_candidates
    from pockengine.backends.c.layout_table import layout_nodes
    from pockengine.backends.c.lowering import lower_for_c

    nodes = layout_nodes(lower_for_c(step.graph))
    return {n.outputs[0].name for n in nodes if len(layout_candidates(n)) == 2}


def test_the_trainer_writes_every_candidates_layout(tuned: tuple[Any, Any, Path]) -> None:
    head, *rows = _lines(tuned)
    assert head.startswith("pockengine-conv-layouts 2 ")
    names = [r.split()[0] for r in rows]
    assert len(names) == len(set(names)) > 10
    assert all(len(r.split()) == 5 and r.split()[1] in ("nchw", "nhwc", "nchwc") for r in rows)
    blocked = _blocked_names(tuned[0])
    assert 0 < len(blocked) < len(names)
    for row in rows:  # an NCHW{c}c time exactly where the node has that kernel
        name, layout, *times = row.split()
        assert (float(times[2]) > 0) == (name in blocked), row
        assert layout != "nchwc" or name in blocked


@pytest.mark.parametrize("layout", ["nhwc", "nchwc", "nchw"])
def test_an_export_takes_the_files_layouts_and_trains_as_the_step(
    layout: str, tmp_path: Path
) -> None:
    """In float64 with AdamW at 1e-4 (as tests/test_c_layout.py: float32 gradients of this
    random network are ill-conditioned), every candidate forced onto ``layout``."""
    from pockengine.backends.c.layout_table import layout_fingerprint, layout_nodes
    from pockengine.backends.c.lowering import lower_for_c

    w = zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=2, size=32, classes=10))
    batches = [w.make_batch(i) for i in range(3)]
    step = pe.compile(w.model, w.loss_fn, batches[0], pe.optim.AdamW(lr=1e-4), backend="c")
    graph = lower_for_c(step.graph)
    names = [n.outputs[0].name for n in layout_nodes(graph)]
    head = f"pockengine-conv-layouts 2 {layout_fingerprint(graph)}"
    blocked = _blocked_names(step)
    rows = [f"{n} {'nhwc' if layout == 'nchwc' and n not in blocked else layout} 1e-6 1e-6 0"
            for n in names]  # fmt: skip
    forced = _with(tmp_path, [head, *rows], tmp_path / "layouts.txt")
    folder = step.export(tmp_path / "trainer", target="c", layouts=forced)
    source = (folder / "step.c").read_text()
    nhwc_nodes = source.count("= conv2d_nhwc")  # their IR lines
    blocked_nodes = source.count("= conv2d_nchwc")
    if layout == "nchw":
        assert nhwc_nodes == blocked_nodes == 0
        return
    if layout == "nchwc":
        assert blocked_nodes == len(blocked) > 10 and nhwc_nodes == len(names) - len(blocked)
        assert "pe_conv2d_nchwc_weight_grad_depthwise_f64(" in source and "NCHW8c" in source
    else:
        assert nhwc_nodes == len(names) > 10
    losses = [step(*b) for b in batches]
    np.testing.assert_allclose(trainer_losses(folder, batches), losses, rtol=1e-8)


def _bad_files(head: str, rows: list[str], blocked: set[str]) -> list[tuple[list[str], str]]:
    first, second = rows[0].split()[0], rows[1].split()[0]
    rest = rows[1:]
    k = next(i for i, r in enumerate(rows) if r.split()[0] not in blocked)
    dense, others = rows[k].split()[0], rows[:k] + rows[k + 1 :]
    return [
        (["pockengine-conv-layouts 2 0123456789abcdef", *rows], ":1: not the layouts of this"),
        (["pockengine-conv-layouts 1 " + head.split()[2], *rows], ":1: not the layouts of this"),
        ([head, "conv2d_nope nhwc 1 1 0", *rows], ":2: 'conv2d_nope' is not a convolution"),
        ([head, *rows, f"{first} nhwc 1 1 0"], "appears twice"),
        ([head, f"{first} nchw4 1 1 0", *rest], ":2: layout 'nchw4' is not nchw, nhwc or nchwc"),
        ([head, f"{dense} nchwc 1 1 1", *others], f":2: {dense!r} has no NCHW{{c}}c kernel"),
        ([head, f"{first} nhwc -1 1 0", *rest], ":2: the times must be seconds"),
        ([head, f"{first} nhwc nan 1 0", *rest], ":2: the times must be seconds"),
        ([head, f"{first} nhwc 1 1", *rest], ":2: expected '<node> <nchw|nhwc|nchwc>"),
        ([head, *rest], f"no layout for {first}"),
        ([head, rows[0]], f"no layout for {second}"),
    ]


def test_a_bad_layout_file_is_one_clear_error_and_writes_nothing(
    tuned: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    step = tuned[0]
    head, *rows = _lines(tuned)
    for k, (lines, message) in enumerate(_bad_files(head, rows, _blocked_names(step))):
        bad = _with(tmp_path, lines, tmp_path / f"bad{k}.txt")
        with pytest.raises(LayoutFileError, match="bad") as info:
            step.export(tmp_path / f"out{k}", target="c", layouts=bad)
        assert message in str(info.value), (message, str(info.value))
        assert not (tmp_path / f"out{k}").exists()
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(LayoutFileError, match="not text"):
        step.export(tmp_path / "outb", target="c", layouts=binary)
    with pytest.raises(LayoutFileError, match="cannot read"):
        step.export(tmp_path / "outm", target="c", layouts=tmp_path / "missing.txt")
    with pytest.raises(LayoutFileError, match="cannot read"):  # a folder where a file belongs
        step.export(tmp_path / "outd", target="c", layouts=tmp_path)
    assert not (tmp_path / "outd").exists()
    with pytest.raises(pe.CompileError, match="goes with target='c'"):
        step.export(tmp_path / "x.onnx", layouts=tuned[2])


def test_the_cli_takes_layouts_with_target_c_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "cnn", "--target", "onnx", "--layouts", "conv-layouts.txt"]) != 0
    assert "--layouts goes with --target c" in capsys.readouterr().err


def test_the_trainer_takes_layouts_with_tune_only(tuned: tuple[Any, Any, Path]) -> None:
    """``--layouts`` in a training run is refused (its layouts are compiled in), and a
    layout file it cannot write fails naming it, leaving no temporary file."""
    folder = tuned[2].parent
    before = sorted(p.name for p in folder.iterdir())
    run = subprocess.run(["./train", "--layouts", "x.txt", "X.npy", "Y.npy"], cwd=folder,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "--layouts goes with --tune" in run.stderr, run.stderr
    run = subprocess.run(["./train", "--tune", "--layouts", "missing/conv-layouts.txt"],
                         cwd=folder, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 1 and "missing/conv-layouts.txt" in run.stderr, run.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
