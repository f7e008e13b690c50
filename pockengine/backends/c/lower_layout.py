"""C lowerings of the layout ops: ``layout_convert``, the NHWC convolutions and the
channel-blocked ones (``ops/layout.py``, ``ops/conv_nhwc.py``, ``ops/conv_blocked.py``),
which the layout pass (``layout.py``) makes.

A conversion is one ``pe_layout_convert`` call (tiled transposes between NCHW and NHWC or
NCHW{c}c). A depthwise NCHW{c}c convolution calls ``kernels/conv_nhwc.c``'s blocked kernels
(one block of c channels a vector run); no other blocked convolution has a C kernel.
A depthwise NHWC convolution (groups = in = out channels) calls ``kernels/conv_nhwc.c``;
a pointwise one (1x1, stride 1, no padding, one group) is one GEMM over every image's
positions, which NHWC lays out as one [N*H*W, C] matrix: ``Y = X W^T`` (+ bias),
``GX = GY W``, ``GW = GY^T X``. Other NHWC convolutions have no C kernel.
"""

from __future__ import annotations

import math

from pockengine.backends.c.conv_kernels import ConvGeometry, conv_geometry
from pockengine.backends.c.emit import CEmitError, EmitContext, Lowering, attr_int
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.ir import Node
from pockengine.ops.layout import block_of

__all__ = ["KERNELS", "MAX_BLOCK", "blocked_kernel", "nhwc_geometry", "nhwc_kernel"]

MAX_BLOCK = 64  # kernels/conv_nhwc.c: PE_NHWC_CB, the widest block its kernels take


def nhwc_geometry(node: Node) -> ConvGeometry:
    """The geometry (conv.c's order: NCHW sizes) of an NHWC convolution node."""
    try:
        return conv_geometry(node)
    except ValueError as e:
        raise CEmitError(f"{node.op}: {e}") from None


def nhwc_kernel(g: ConvGeometry) -> str | None:
    """``pointwise`` or ``depthwise`` (multiplier 1) when ``g`` has an NHWC kernel, else None."""
    if g.pointwise:
        return "pointwise"
    return "depthwise" if g.depthwise and g.o == g.c else None


def blocked_kernel(g: ConvGeometry) -> bool:
    """Whether ``g`` has an NCHW{c}c kernel: depthwise with one filter a channel."""
    return g.depthwise and g.o == g.c


def _blocked(node: Node) -> tuple[ConvGeometry, int]:
    g = nhwc_geometry(node)
    block = attr_int(node, "block")
    if not blocked_kernel(g) or not 2 <= block <= MAX_BLOCK:
        raise CEmitError(
            f"{node.op}: only depthwise NCHW{{c}}c convolutions with 2 <= c <= {MAX_BLOCK} "
            f"run in C (block {block})"
        )
    return g, block


def _conv2d_nchwc(ctx: EmitContext, node: Node) -> str:
    """Any of the three blocked ops: ``pe_<op>_depthwise_<sfx>(activations and filter
    (the forward's bias, or NULL), result, geometry, block)``."""
    out = node.outputs[0]
    g, block = _blocked(node)
    args = [ctx.ref(v) for v in node.inputs]
    if node.op == "conv2d_nchwc" and len(args) == 2:
        args.append("NULL")  # no bias
    geom = ctx.longs("conv", g.longs())
    return (
        f"pe_{node.op}_depthwise_{_sfx(out)}({', '.join(args)}, {ctx.ref(out)}, {geom}, {block});"
    )


def _kernel(node: Node) -> tuple[ConvGeometry, str]:
    g = nhwc_geometry(node)
    kernel = nhwc_kernel(g)
    if kernel is None:
        raise CEmitError(f"{node.op}: only depthwise and pointwise NHWC convolutions run in C")
    return g, kernel


def _layout_convert(ctx: EmitContext, node: Node) -> str:
    x, out = node.inputs[0], node.outputs[0]
    src, dst = (block_of(node.op, node.attrs[k]) for k in ("src", "dst"))
    channels = attr_int(node, "channels")
    h, w = (x.shape[1], x.shape[2]) if src < 0 else (x.shape[2], x.shape[3])
    dims = f"{x.shape[0]}, {channels}, {h}, {w}"
    return f"pe_layout_convert_{_sfx(out)}({ctx.ref(x)}, {ctx.ref(out)}, {dims}, {src}, {dst});"


def _gemm(out: str, m: int, n: int, k: int, a: str, lda: int, ta: int, b: str, ldb: int, tb: int,
          c: str) -> str:  # fmt: skip
    return f"pe_gemm_{out}({m}, {n}, {k}, {a}, {lda}, {ta}, {b}, {ldb}, {tb}, {c}, {n}, 0);"


def _conv2d_nhwc(ctx: EmitContext, node: Node) -> str:
    x, w = node.inputs[:2]
    out = node.outputs[0]
    g, kernel = _kernel(node)
    bias = ctx.ref(node.inputs[2]) if len(node.inputs) > 2 else "NULL"
    if kernel == "depthwise":
        geom = ctx.longs("conv", g.longs())
        args = f"{ctx.ref(x)}, {ctx.ref(w)}, {bias}, {ctx.ref(out)}, {geom}"
        return f"pe_conv2d_nhwc_depthwise_{_sfx(out)}({args});"
    rows = math.prod(x.shape[:3])
    y = ctx.ref(out)
    call = _gemm(_sfx(out), rows, g.o, g.c, ctx.ref(x), g.c, 0, ctx.ref(w), g.c, 1, y)
    if bias == "NULL":
        return call
    add = f"for (long i = 0; i < {rows}; i++) for (long j = 0; j < {g.o}; j++) "
    return f"{{ {call} {add}{y}[i * {g.o} + j] += {bias}[j]; }}"


def _conv2d_nhwc_input_grad(ctx: EmitContext, node: Node) -> str:
    gy, w = node.inputs
    out = node.outputs[0]
    g, kernel = _kernel(node)
    if kernel == "depthwise":
        geom = ctx.longs("conv", g.longs())
        args = f"{ctx.ref(gy)}, {ctx.ref(w)}, {ctx.ref(out)}, {geom}"
        return f"pe_conv2d_nhwc_input_grad_depthwise_{_sfx(out)}({args});"
    rows = math.prod(gy.shape[:3])
    return _gemm(_sfx(out), rows, g.c, g.o, ctx.ref(gy), g.o, 0, ctx.ref(w), g.c, 0, ctx.ref(out))


def _conv2d_nhwc_weight_grad(ctx: EmitContext, node: Node) -> str:
    x, gy = node.inputs
    out = node.outputs[0]
    g, kernel = _kernel(node)
    if kernel == "depthwise":
        geom = ctx.longs("conv", g.longs())
        args = f"{ctx.ref(x)}, {ctx.ref(gy)}, {ctx.ref(out)}, {geom}"
        return f"pe_conv2d_nhwc_weight_grad_depthwise_{_sfx(out)}({args});"
    rows = math.prod(x.shape[:3])
    return _gemm(_sfx(out), g.o, g.c, rows, ctx.ref(gy), g.o, 1, ctx.ref(x), g.c, 0, ctx.ref(out))


KERNELS: dict[str, Lowering] = {
    "layout_convert": _layout_convert,
    "conv2d_nhwc": _conv2d_nhwc,
    "conv2d_nhwc_input_grad": _conv2d_nhwc_input_grad,
    "conv2d_nhwc_weight_grad": _conv2d_nhwc_weight_grad,
    "conv2d_nchwc": _conv2d_nchwc,
    "conv2d_nchwc_input_grad": _conv2d_nchwc,
    "conv2d_nchwc_weight_grad": _conv2d_nchwc,
}
