"""The C step's arena is planned after the layout pass, so it places the buffers that the
pass inserts (each NHWC copy of an activation and each NHWC result) for as long as they
live: a tuned small CNN with every candidate in NHWC has each such value inside the arena,
clear of every value live beside it, and the arena is at least the lowered graph's live
peak, conversions included."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.c import CBackend, layout_tune, tune
from pockengine.plan.liveness import liveness

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip

_INSERTED = ("layout_convert", "conv2d_nhwc", "conv2d_nhwc_input_grad", "conv2d_nhwc_weight_grad")


def _favour_nhwc(op: str, nchw: str, *args: Any) -> dict[str, float]:
    return {nchw: 2e-6, layout_tune.NHWC_KERNEL: 1e-6}


def test_the_arena_places_every_buffer_the_layout_pass_inserts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(layout_tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(tune, "measure", lambda op, kernels, *a: {k: 1e-6 for k in kernels})
    monkeypatch.setattr(layout_tune, "measure_layouts", _favour_nhwc)
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.SGD(lr=0.05),
                      backend=CBackend(tune=True))  # fmt: skip
    graph, plan = step._exec.graph, step._exec.plan
    inserted = {v.name for n in graph.nodes if n.op in _INSERTED for v in n.outputs}
    assert len(inserted) >= 6  # the depthwise and pointwise layers' NHWC values
    intervals = plan.liveness.intervals
    assert inserted <= set(plan.offsets)
    assert plan.arena_bytes >= liveness(graph).peak_bytes >= plan.peak_live_bytes > 0
    for name in inserted:
        mine, lo = intervals[name], plan.offsets[name]
        assert lo + mine.nbytes <= plan.arena_bytes
        for other, iv in intervals.items():
            if other == name or not iv.nbytes or not mine.overlaps(iv):
                continue
            at = plan.offsets[other]
            handed_over = at == lo and (mine.end == iv.start or iv.end == mine.start)
            assert handed_over or lo + mine.nbytes <= at or at + iv.nbytes <= lo, (name, other)
