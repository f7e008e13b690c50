"""C statements of the fused depthwise and pointwise convolutions over a batch-normed,
clipped input (``ops/conv_bn_act.py``, made by ``fuse_dw_bn.py``): calls of
``kernels/dw_bn.c``."""

from __future__ import annotations

from pockengine.backends.c.conv_kernels import conv_geometry
from pockengine.backends.c.emit import EmitContext, Lowering, attr_float
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import Node

__all__ = ["KERNELS"]


def _tail(ctx: EmitContext, node: Node, conv: Node) -> str:
    """The geometry array (of the convolution ``conv`` stands for), eps and the bounds."""
    geom = ctx.longs("conv", conv_geometry(conv).longs())
    bounds = ", ".join(repr(attr_float(node, k)) for k in ("eps", "min_val", "max_val"))
    return f"{geom}, {bounds}"


def _conv2d_bn_hardtanh(ctx: EmitContext, node: Node) -> str:
    x, bw, bb, w = node.inputs[:4]
    bias = ctx.ref(node.inputs[4]) if len(node.inputs) > 4 else "NULL"
    y, mean, var = (ctx.ref(v) for v in node.outputs)
    conv = node.replace(op="conv2d", inputs=(x, *node.inputs[3:]), outputs=node.outputs[:1])
    ins = ", ".join(ctx.ref(v) for v in (x, bw, bb))
    if conv_geometry(conv).pointwise:  # fuse_dw_bn fuses those without a bias only
        return (
            f"pe_conv2d_pointwise_bn_hardtanh_{_sfx(x)}({ins}, {mean}, {var}, {ctx.ref(w)}, "
            f"{y}, {_tail(ctx, node, conv)});"
        )
    return (
        f"pe_conv2d_bn_hardtanh_{_sfx(x)}({ins}, {mean}, {var}, {ctx.ref(w)}, {bias}, {y}, "
        f"{_tail(ctx, node, conv)});"
    )


def _conv2d_bn_hardtanh_weight_grad(ctx: EmitContext, node: Node) -> str:
    x, gy = node.inputs[0], node.inputs[5]
    conv = node.replace(op="conv2d_weight_grad", inputs=(x, gy))
    ins = ", ".join(ctx.ref(v) for v in node.inputs)
    return (
        f"pe_conv2d_bn_hardtanh_weight_grad_{_sfx(x)}({ins}, {ctx.ref(node.outputs[0])}, "
        f"{_tail(ctx, node, conv)});"
    )


KERNELS: dict[str, Lowering] = {
    "conv2d_bn_hardtanh": _conv2d_bn_hardtanh,
    "conv2d_bn_hardtanh_weight_grad": _conv2d_bn_hardtanh_weight_grad,
}
