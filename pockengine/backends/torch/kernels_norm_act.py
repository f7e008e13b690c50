"""The torch kernels of ``batch_norm_hardtanh``, its gradient and ``batch_norm_apply``
(``ops/norm_act.py``), and of the convolutions reading them (``ops/conv_bn_act.py``).

Only the C backend makes these ops (``backends/c/fuse_bn.py``); here they are the unfused
ATen calls, so a graph holding them (an op-table test, a rewritten graph) runs on torch too.
"""

from __future__ import annotations

from pockengine.backends.torch.codegen import Emit, Emitter, literal

__all__ = ["KERNELS"]


def _bounds(e: Emit) -> str:
    return f"{literal(float(e.attr('min_val')))}, {literal(float(e.attr('max_val')))}"


def _trained_clipped(e: Emit, x: str, w: str, b: str, z: str, mean: str, var: str) -> list[str]:
    """ATen's training-mode batch norm of x into z, clipped; the biased variance is
    1/std^2 - eps."""
    eps = literal(float(e.attr("eps")))
    invstd = e.tmp()
    call = f"aten_native_batch_norm({x}, {w}, {b}, None, None, True, 0.0, {eps})"
    return [
        f"{z}, {mean}, {invstd} = {call}",
        f"{z} = aten_clamp({z}, {_bounds(e)})",
        f"{var} = {invstd}.pow(-2).sub_({eps})",
    ]


def _normalised(e: Emit, k: int, w: str, b: str, mean: str, var: str) -> str:
    """batch_norm's y from the node's input ``k`` and given statistics, by its operations."""
    eps = literal(float(e.attr("eps")))
    view = literal((-1, *([1] * (e.node.inputs[k].type.rank - 2))))
    scale = f"({w} / aten_add({var}, {eps}).sqrt()).view({view})"
    return f"({e.ins[k]} - {mean}.view({view})) * {scale} + {b}.view({view})"


def _batch_norm_hardtanh(e: Emit) -> list[str]:
    """ATen's training-mode batch norm, clipped."""
    return _trained_clipped(e, *e.ins, *e.outs)


def _batch_norm_hardtanh_grad(e: Emit) -> list[str]:
    """y from x and the saved statistics (batch_norm's operations), the hardtanh mask, then
    ATen's batch-norm backward."""
    gz, x, w, b, mean, var = e.ins
    eps = literal(float(e.attr("eps")))
    y, invstd = e.tmp(), e.tmp()
    mask = literal(e.used)
    args = f"{y}, {x}, {w}, None, None, {mean}, {invstd}, True, {eps}, {mask}"
    return [
        f"{y} = {_normalised(e, 1, w, b, mean, var)}",
        f"{y} = aten_hardtanh_backward({gz}, {y}, {_bounds(e)})",
        f"{invstd} = aten_rsqrt(aten_add({var}, {eps}))",
        f"{', '.join(e.outs)} = aten_native_batch_norm_backward({args})",
    ]


def _batch_norm_apply(e: Emit) -> list[str]:
    """y from x and the given statistics (batch_norm's operations), clipped when bounded."""
    _, w, b, mean, var = e.ins
    stmts = [f"{e.out} = {_normalised(e, 0, w, b, mean, var)}"]
    if e.attr("min_val") is not None:
        stmts.append(f"{e.out} = aten_clamp({e.out}, {_bounds(e)})")
    return stmts


def _geometry(e: Emit) -> str:
    keys = ("stride", "padding", "dilation")
    return ", ".join(literal(tuple(e.attr(k))) for k in keys) + f", {e.attr('groups')}"


def _conv2d_bn_hardtanh(e: Emit) -> list[str]:
    """batch_norm_hardtanh's statements into a temporary, then the convolution."""
    x, bw, bb, w, *bias = e.ins
    y, mean, var = e.outs
    z = e.tmp()
    conv = f"{y} = aten_conv2d({z}, {w}, {bias[0] if bias else 'None'}, {_geometry(e)})"
    return [*_trained_clipped(e, x, bw, bb, z, mean, var), conv]


def _conv2d_bn_hardtanh_weight_grad(e: Emit) -> list[str]:
    """batch_norm_apply's statements (clipped) into a temporary, then the weight gradient."""
    _, bw, bb, mean, var, gy = e.ins
    z = e.tmp()
    shape = literal(tuple(e.attr("w_shape")))
    grad = f"aten_convolution_backward({gy}, {z}, {z}.new_zeros(1).expand({shape}), None, "
    return [
        f"{z} = {_normalised(e, 0, bw, bb, mean, var)}",
        f"{z} = aten_clamp({z}, {_bounds(e)})",
        f"{e.out} = {grad}{_geometry_transposed(e)}, (False, True, False))[1]",
    ]


def _geometry_transposed(e: Emit) -> str:
    """convolution_backward's geometry: stride, padding, dilation, transposed, output
    padding, groups."""
    keys = ("stride", "padding", "dilation")
    pairs = ", ".join(literal(tuple(e.attr(k))) for k in keys)
    return f"{pairs}, False, (0, 0), {e.attr('groups')}"


KERNELS: dict[str, Emitter] = {
    "conv2d_bn_hardtanh": _conv2d_bn_hardtanh,
    "conv2d_bn_hardtanh_weight_grad": _conv2d_bn_hardtanh_weight_grad,
    "batch_norm_hardtanh": _batch_norm_hardtanh,
    "batch_norm_hardtanh_grad": _batch_norm_hardtanh_grad,
    "batch_norm_apply": _batch_norm_apply,
}
