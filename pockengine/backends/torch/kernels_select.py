"""The torch kernel table, part three: selection ops (``topk``, ``index_put_add``).

``topk`` is ATen's (sorted, best first); ``index_put_add`` is ATen's out-of-place
``index_put`` with ``accumulate=True`` over the index list ``index`` uses (None on the
axes that are not indexed; ATen counts negative indices from the end, as the IR).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal
from pockengine.backends.torch.kernels_shape import index_list
from pockengine.ops._common import norm_axis

__all__ = ["KERNELS", "NAMESPACE"]

_aten = torch.ops.aten


def _topk(e: Emit) -> list[str]:
    x = e.node.inputs[0]
    axis = norm_axis(e.attr("axis"), x.type.rank)
    largest = literal(bool(e.get("largest", True)))
    call = f"aten_topk({e.ins[0]}, {int(e.attr('k'))}, {axis}, {largest}, True)"
    return [f"{', '.join(e.outs)} = {call}"]


def _index_put_add(e: Emit) -> list[str]:
    x, values = e.ins[0], e.ins[1]
    indices = index_list(e, e.node.inputs[0].type.rank, first=2)
    return [f"{e.out} = aten_index_put({x}, {indices}, {values}, True)"]


KERNELS: dict[str, Emitter] = {
    "topk": _topk,
    "index_put_add": _index_put_add,
}

NAMESPACE: dict[str, Callable[..., Any]] = {
    "aten_topk": _aten.topk.default,
    "aten_index_put": _aten.index_put.default,
}
