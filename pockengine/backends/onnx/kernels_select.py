"""ONNX kernels of the selection ops: ``topk`` is TopK (sorted; ONNX puts the lower index
first among equal values, as the reference); ``index_put_add`` is ScatterND with
``reduction="add"`` into the tensor itself, its indexed axes moved to the front as for
``index`` (kernels_shape.py), then moved back.
"""

from __future__ import annotations

import numpy as np

from pockengine.backends.onnx.emitter import Emitter, Kernel, registrar
from pockengine.backends.onnx.kernels_shape import index_plan, result_perm, stacked_index
from pockengine.ir import Node
from pockengine.ops._common import norm_axis

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


@_k("topk")
def _topk(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    k, axis = node.attrs["k"], node.attrs["axis"]
    assert isinstance(k, int) and isinstance(axis, int)
    largest = int(bool(node.attrs.get("largest", True)))
    rank = node.inputs[0].type.rank
    em.op_multi(
        "TopK", x[0], em.ints([k]), outs=out, axis=norm_axis(axis, rank), largest=largest, sorted=1
    )


@_k("index_put_add")
def _index_put_add(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    shape = node.inputs[0].shape
    axes, perm, batch = index_plan(node, shape, first=2)
    back = result_perm(axes, len(batch), len(shape))
    values = x[1]
    if back is not None:
        values = em.op("Transpose", values, perm=[int(i) for i in np.argsort(back)])
    data = x[0] if perm == sorted(perm) else em.op("Transpose", x[0], perm=perm)
    index = stacked_index(em, node, x, shape, first=2)
    inverse = [int(i) for i in np.argsort(perm)]
    if inverse == sorted(inverse):
        em.op("ScatterND", data, index, values, out=out[0], reduction="add")
        return
    scattered = em.op("ScatterND", data, index, values, reduction="add")
    em.op("Transpose", scattered, out=out[0], perm=inverse)
