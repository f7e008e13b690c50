"""C lowerings of the selection ops: ``topk`` calls ``pe_topk`` (kernels/select.c);
``index_put_add`` copies its input and adds the values in a generated loop over the
indexed positions (the loop nest of ``index``, lower_ew.py), skipping an index outside
its axis as ``index_grad`` does: no index value writes outside the result.
"""

from __future__ import annotations

import math

from pockengine.backends.c.emit import EmitContext, Lowering, attr_int
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.backends.c.lower_ew import indexed_loop
from pockengine.ir import Node

__all__ = ["KERNELS"]


def _topk(ctx: EmitContext, node: Node) -> str:
    (x,) = node.inputs
    values, indices = node.outputs
    axis = attr_int(node, "axis") % x.type.rank
    outer, n, inner = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :])
    largest = int(bool(node.attrs.get("largest", True)))
    args = f"{ctx.ref(x)}, {ctx.ref(values)}, {ctx.ref(indices)}, {outer}, {n}, {inner}"
    return f"pe_topk_{_sfx(x)}({args}, {attr_int(node, 'k')}, {largest});"


def _index_put_add(ctx: EmitContext, node: Node) -> str:
    x, values, *indices = node.inputs
    out = node.outputs[0]
    _sfx(out)
    header, offset, inside, flat = indexed_loop(ctx, node, x.shape, indices)
    return (
        f"{{ memcpy({ctx.ref(out)}, {ctx.ref(x)}, {out.type.nbytes}); "
        f"{header}if ({inside}) {ctx.ref(out)}[{offset}] += {ctx.ref(values)}[{flat}]; }}"
    )


KERNELS: dict[str, Lowering] = {
    "topk": _topk,
    "index_put_add": _index_put_add,
}
