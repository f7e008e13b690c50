"""Reshapes and transposes the C step runs as views (``backends/c/views.py``).

- a reshape shares its input's buffer even when the input is read again later, and the
  plan keeps that buffer alive for both readers; a reshape that is a graph output copies;
- a transpose read only by matrix products (``linear``'s weight, either side of ``matmul``,
  batched or not) writes nothing: the GEMM packs the source strided; one read by anything
  else is still copied, and so is one whose source an update writes before it is read;
- the head split (``(0, 2, 1, 3)``) of an attention's q, k, v and output gradient is read at
  a row stride by the attention kernels;
- every result equals the NumPy backend's on the same graph.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest

from pockengine.backends.c import CBackend, CExecutable
from pockengine.backends.c.views import step_views
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.ir import DType, Graph, GraphBuilder, Role, TensorType, Value

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip
F32 = DType.F32


def _random(graph: Graph, seed: int) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {v.name: np.asarray(rng.standard_normal(v.shape), np.float32) for v in graph.inputs}


def _run_both(graph: Graph, seed: int = 0) -> tuple[CExecutable, list[Array], list[Array]]:
    values = _random(graph, seed)
    persistent = {v.name for v in graph.inputs if v.role is not Role.INPUT}
    store = {k: a.copy() for k, a in values.items() if k in persistent}
    feeds = {k: a for k, a in values.items() if k not in persistent}
    ex = CBackend().compile(graph)
    assert isinstance(ex, CExecutable)
    got = ex.run(store, feeds)
    want = NumpyBackend().compile(graph).run({k: a.copy() for k, a in values.items()})
    return ex, got, want


def _close(got: list[Array], want: list[Array]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_a_reshape_read_with_its_input_shares_the_buffer() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((6, 8), F32), Role.INPUT)
    w = b.input("w", TensorType((8, 4), F32), Role.PARAM)
    s = b.call("add", x, x)
    r = b.call("reshape", s, shape=(48,))  # s is read again after its reshape
    z = b.call("matmul", s, w)
    big = b.call("mul", r, r)
    out = b.call("reshape", z, shape=(24,))  # a graph output: copied
    graph = b.build([big, out, b.call("sum", s, axes=None, keepdims=False)])
    ex, got, want = _run_both(graph)
    at = ex.plan.offsets
    assert at[s.name] == at[r.name] and at[z.name] != at[out.name]
    assert ex.source.count("memmove(") == 1 and "a view: no statement" in ex.source
    _close(got, want)


def _products() -> tuple[Graph, list[Value]]:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2, 37, 24), F32), Role.INPUT)
    w = b.input("w", TensorType((40, 24), F32), Role.PARAM)  # linear's weight, [out, in]
    bias = b.input("bias", TensorType((40,), F32), Role.PARAM)
    y = b.input("y", TensorType((37, 40), F32), Role.INPUT)
    h = b.call("linear", x, b.call("transpose", w, perm=(1, 0)), bias)  # [2, 37, 40]
    h2 = b.call("reshape", h, shape=(74, 40))
    x2 = b.call("reshape", x, shape=(74, 24))
    gw = b.call("matmul", b.call("transpose", h2, perm=(1, 0)), x2)
    gx = b.call("matmul", y, b.call("transpose", b.call("transpose", w, perm=(1, 0)), perm=(1, 0)))
    c = b.input("c", TensorType((2, 16, 37), F32), Role.INPUT)
    hb, cb = (b.call("transpose", t, perm=(0, 2, 1)) for t in (h, c))
    att = b.call("matmul", hb, cb)  # batched, both sides strided
    copied = b.call("transpose", y, perm=(1, 0))
    graph = b.build([gw, gx, att, b.call("add", copied, copied)])
    return graph, [copied]


def test_transposes_read_by_products_write_nothing() -> None:
    graph, copied = _products()
    views = step_views(graph)
    transposes = [n.outputs[0].name for n in graph.nodes if n.op == "transpose"]
    kept = {v.name for v in copied}
    # the transpose read by a transpose (gx's inner one) and the one read by add are copies
    inner = [n for n in graph.nodes if n.op == "transpose" and n.inputs[0].name == "w"][1]
    kept.add(inner.outputs[0].name)
    assert {t for t in transposes if t not in views} == kept
    ex, got, want = _run_both(graph, seed=1)
    assert ex.source.count("a view: no statement") == len(views)
    _close(got, want)


def test_a_transpose_of_a_param_updated_before_its_read_is_copied() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((5, 6), F32), Role.INPUT)
    w = b.input("w", TensorType((4, 6), F32), Role.PARAM)
    g = b.input("g", TensorType((4, 6), F32), Role.INPUT)
    t_early = b.call("transpose", w, perm=(1, 0))
    lr = b.input("lr", TensorType((), F32), Role.STATE)
    b.call_multi("sgd_update", w, g, lr, weight_decay=0.0)
    t_late = b.call("transpose", w, perm=(1, 0))
    graph = b.build([b.call("matmul", x, t_early), b.call("matmul", x, t_late)])
    views = step_views(graph)
    assert t_early.name not in views and t_late.name in views
    _, got, want = _run_both(graph, seed=2)
    _close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_reads_split_heads_strided(causal: bool) -> None:
    bsz, length, heads, e = 2, 19, 3, 8
    b = GraphBuilder("g")
    split = TensorType((bsz, length, heads, e), F32)
    qs, ks, vs, gs = (b.input(n, split, Role.INPUT) for n in ("q", "k", "v", "go"))
    q, k, v, go = (b.call("transpose", t, perm=(0, 2, 1, 3)) for t in (qs, ks, vs, gs))
    out, lse = b.call_multi("attention", q, k, v, scale=0.3, causal=causal)
    grads = b.call_multi("attention_grad", go, q, k, v, out, lse, scale=0.3, causal=causal)
    graph = b.build([out, lse, *grads])
    assert sum(view.transposed for view in step_views(graph).values()) == 4
    _, got, want = _run_both(graph, seed=3)
    _close(got, want)


@pytest.mark.parametrize("mask", ["causal", "causal tensor", "padding"])
@pytest.mark.parametrize("queries,keys", [(300, 300), (170, 300), (300, 170)])
def test_attention_skips_unseen_keys_over_several_query_tiles(
    mask: str, queries: int, keys: int
) -> None:
    # 300 keys make tiles of 54 queries. A tile stops at the last key one of its queries can
    # see (causal, or a -inf mask: a causal mask as a tensor, padding that hides every key
    # of some queries), and gk and gv start from zero for keys that no tile reaches.
    b = GraphBuilder("g")
    q = b.input("q", TensorType((1, 2, queries, 8), F32), Role.INPUT)
    k, v = (b.input(n, TensorType((1, 2, keys, 8), F32), Role.INPUT) for n in ("k", "v"))
    go = b.input("go", TensorType((1, 2, queries, 8), F32), Role.INPUT)
    extra: list[Value] = []
    if mask != "causal":
        extra.append(b.input("mask", TensorType((1, 1, queries, keys), F32), Role.INPUT))
    attrs = {"scale": 0.3, "causal": mask == "causal"}
    out, lse = b.call_multi("attention", q, k, v, *extra, **attrs)
    grads = b.call_multi("attention_grad", go, q, k, v, out, lse, *extra, **attrs)
    graph = b.build([out, lse, *grads])
    values = _random(graph, seed=4)
    rows, cols = np.indices((queries, keys))
    if mask == "causal tensor":
        values["mask"] = np.where(cols <= rows, 0.0, -np.inf).astype(np.float32)[None, None]
    elif mask == "padding":  # the first 60 queries see nothing, the rest the first 100 keys
        hidden = (cols >= 100) | (rows < 60)
        values["mask"] = np.where(hidden, -np.inf, 0.0).astype(np.float32)[None, None]
    ex, _, _ = _run_both(graph, seed=5)  # leaves its results in the step's buffers
    got = ex.run({}, values)
    want = NumpyBackend().compile(graph).run(values)
    _close(got, want)
