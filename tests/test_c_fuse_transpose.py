"""The C backend's rewrite of transposed matrix products (``backends/c/fuse_transpose.py``):
``transpose(matmul(a, b))`` becomes ``matmul(transpose(b), transpose(a))``, a transposed
transpose reads its source, so a weight gradient is written in the weight's own layout and
the step copies no transpose (every one left is a view the GEMM packs strided); a source
an update writes is transposed anew; a product read by anything else, or batched, stays;
every result equals the NumPy backend's on the original graph; a LLaMA step's weight
gradients all qualify."""

from __future__ import annotations

import os
import shutil

import pytest

from pockengine.backends.c.fuse_transpose import transpose_products
from pockengine.backends.c.views import step_views
from pockengine.ir import DType, Graph, GraphBuilder, Role, TensorType, verify
from tests.test_c_views import _close, _run_both

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip
F32 = DType.F32


def _copied(graph: Graph) -> list[str]:
    """The transposes the C step copies (not views)."""
    views = step_views(graph)
    return [n.outputs[0].name for n in graph.nodes
            if n.op == "transpose" and n.outputs[0].name not in views]  # fmt: skip


def _weight_gradient(updated: bool) -> Graph:
    """gw = transpose(matmul(transpose(x), gy)), the update of w reading it; with
    ``updated``, an update writes x (a param) after the inner transpose reads it."""
    b = GraphBuilder("g")
    x = b.input("x", TensorType((6, 8), F32), Role.PARAM if updated else Role.INPUT, True)
    gy = b.input("gy", TensorType((6, 4), F32), Role.INPUT)
    w = b.input("w", TensorType((4, 8), F32), Role.PARAM, trainable=True)
    lr = b.input("lr", TensorType((), F32), Role.STATE)
    xt = b.call("transpose", x, perm=(1, 0))
    if updated:
        b.call_multi("sgd_update", x, b.call("add", x, x), lr, weight_decay=0.0)
    gw = b.call("transpose", b.call("matmul", xt, gy), perm=(1, 0))
    b.call_multi("sgd_update", w, gw, lr, weight_decay=0.0)
    return b.build([gw, b.call("sum", gw, axes=None, keepdims=False)])


@pytest.mark.parametrize("updated", [False, True])
def test_a_weight_gradient_is_written_in_the_weights_layout(updated: bool) -> None:
    graph = _weight_gradient(updated)
    # before: the gradient turned round (and x's transpose, read after x's update)
    assert len(_copied(graph)) == 1 + updated
    lowered = transpose_products(graph)
    verify(lowered)
    assert len(_copied(lowered)) == updated
    product = next(n for n in lowered.nodes if n.op == "matmul")
    assert product.outputs[0].name == graph.outputs[0].name
    assert product.inputs[0].shape == (4, 6) and product.inputs[1].shape == (6, 8)
    # x as it was before its update: read through a new transpose of the old transpose
    assert (product.inputs[1].name == "x") is not updated
    _, got, want = _run_both(graph, seed=3)  # the C step runs the rewrite
    _close(got, want)


def test_a_product_read_elsewhere_or_batched_stays() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((5, 3), F32), Role.INPUT)
    y = b.input("y", TensorType((3, 4), F32), Role.INPUT)
    shared = b.call("matmul", x, y)
    u = b.input("u", TensorType((2, 5, 3), F32), Role.INPUT)
    v = b.input("v", TensorType((2, 3, 4), F32), Role.INPUT)
    batched = b.call("transpose", b.call("matmul", u, v), perm=(0, 2, 1))
    graph = b.build([b.call("transpose", shared, perm=(1, 0)), shared, batched])
    assert transpose_products(graph) is graph
    _, got, want = _run_both(graph, seed=4)
    _close(got, want)


def test_a_llama_step_copies_no_weight_gradient() -> None:
    import pockengine as pe
    from pockengine import zoo

    work = zoo.llama_lm()
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), pe.optim.AdamW(lr=1e-3),
                      backend="numpy", compile_in="process")  # fmt: skip
    graph = step.graph
    updates = {n.inputs[1].name for n in graph.nodes if n.op == "adamw_update"}
    turned = [n for n in graph.nodes if n.op == "transpose" and n.outputs[0].name in updates]
    assert len(turned) >= 7 * 2  # the seven projections of each of two layers
    lowered = transpose_products(graph)
    verify(lowered)
    kept = set(_copied(lowered))
    assert kept.isdisjoint(updates) and len(kept) == len(_copied(graph)) - len(turned)


def test_a_product_of_a_turned_product_is_turned_too_and_the_rewrite_settles() -> None:
    """``r = transpose(matmul(transpose(matmul(a, b)), c))``: the inner product is
    turned, so the outer one must not read its old (gone) result; running the rewrite
    again changes nothing, as the C backend runs it once in the pipeline and again in
    its executable."""
    b = GraphBuilder("g")
    a = b.input("a", TensorType((3, 4), F32), Role.INPUT)
    m = b.input("m", TensorType((4, 5), F32), Role.INPUT)
    c = b.input("c", TensorType((3, 2), F32), Role.INPUT)
    inner = b.call("transpose", b.call("matmul", a, m), perm=(1, 0))  # [5, 3]
    outer = b.call("transpose", b.call("matmul", inner, c), perm=(1, 0))  # [2, 5]
    graph = b.build([b.call("sum", outer, axes=None, keepdims=False)])
    lowered = transpose_products(graph)
    verify(lowered)
    assert transpose_products(lowered) is lowered
    assert not [n for n in lowered.nodes
                if n.op == "transpose" and n.inputs[0].name in
                {p.outputs[0].name for p in lowered.nodes if p.op == "matmul"}]  # fmt: skip
    _, got, want = _run_both(graph)  # the C backend lowers it itself
    _close(got, want)
