"""C lowerings of the selection ops: ``topk`` calls ``pe_topk`` (kernels/select.c);
``index_put_add`` copies its input and adds the values in a generated loop over the
indexed positions (the loop nest of ``index``, lower_ew.py), skipping an index outside
its axis as ``index_grad`` does: no index value writes outside the result.
"""

from __future__ import annotations

import math

from pockengine.backends.c.emit import CEmitError, EmitContext, Lowering, attr_int, strides
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.backends.c.lower_ew import index_access, index_in_range
from pockengine.ir import DType, Node

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
    for v in indices:
        if v.dtype is not DType.I64:
            raise CEmitError(f"index {v} is {v.dtype}; the C kernels take i64 indices")
    out = node.outputs[0]
    _sfx(out)
    shape, header, offset = index_access(ctx, node, x.shape, indices)
    inside = index_in_range(ctx, node, x.shape, indices)
    flat = " + ".join(f"o{a} * {s}" for a, s in enumerate(strides(shape))) or "0"
    return (
        f"{{ memcpy({ctx.ref(out)}, {ctx.ref(x)}, {out.type.nbytes}); "
        f"{header}if ({inside}) {ctx.ref(out)}[{offset}] += {ctx.ref(values)}[{flat}]; }}"
    )


KERNELS: dict[str, Lowering] = {
    "topk": _topk,
    "index_put_add": _index_put_add,
}
