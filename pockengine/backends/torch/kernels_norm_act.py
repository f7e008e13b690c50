"""The torch kernels of ``batch_norm_hardtanh``, its gradient and ``batch_norm_apply``
(``ops/norm_act.py``).

Only the C backend makes these ops (``backends/c/fuse_bn.py``); here they are the unfused
ATen calls, so a graph holding them (an op-table test, a rewritten graph) runs on torch too.
"""

from __future__ import annotations

from pockengine.backends.torch.codegen import Emit, Emitter, literal

__all__ = ["KERNELS"]


def _bounds(e: Emit) -> str:
    return f"{literal(float(e.attr('min_val')))}, {literal(float(e.attr('max_val')))}"


def _batch_norm_hardtanh(e: Emit) -> list[str]:
    """ATen's training-mode batch norm, clipped; the biased variance is 1/std^2 - eps."""
    x, w, b = e.ins
    z, mean, var = e.outs
    eps = literal(float(e.attr("eps")))
    invstd = e.tmp()
    call = f"aten_native_batch_norm({x}, {w}, {b}, None, None, True, 0.0, {eps})"
    return [
        f"{z}, {mean}, {invstd} = {call}",
        f"{z} = aten_clamp({z}, {_bounds(e)})",
        f"{var} = {invstd}.pow(-2).sub_({eps})",
    ]


def _batch_norm_hardtanh_grad(e: Emit) -> list[str]:
    """y from x and the saved statistics (batch_norm's operations), the hardtanh mask, then
    ATen's batch-norm backward."""
    gz, x, w, b, mean, var = e.ins
    eps = literal(float(e.attr("eps")))
    view = literal((-1, *([1] * (e.node.inputs[1].type.rank - 2))))
    y, invstd = e.tmp(), e.tmp()
    scale = f"({w} / aten_add({var}, {eps}).sqrt()).view({view})"
    mask = literal(e.used)
    args = f"{y}, {x}, {w}, None, None, {mean}, {invstd}, True, {eps}, {mask}"
    return [
        f"{y} = ({x} - {mean}.view({view})) * {scale} + {b}.view({view})",
        f"{y} = aten_hardtanh_backward({gz}, {y}, {_bounds(e)})",
        f"{invstd} = aten_rsqrt(aten_add({var}, {eps}))",
        f"{', '.join(e.outs)} = aten_native_batch_norm_backward({args})",
    ]


def _batch_norm_apply(e: Emit) -> list[str]:
    """y from x and the given statistics (batch_norm's operations), clipped when bounded."""
    x, w, b, mean, var = e.ins
    eps = literal(float(e.attr("eps")))
    view = literal((-1, *([1] * (e.node.inputs[0].type.rank - 2))))
    scale = f"({w} / aten_add({var}, {eps}).sqrt()).view({view})"
    stmts = [f"{e.out} = ({x} - {mean}.view({view})) * {scale} + {b}.view({view})"]
    if e.attr("min_val") is not None:
        stmts.append(f"{e.out} = aten_clamp({e.out}, {_bounds(e)})")
    return stmts


KERNELS: dict[str, Emitter] = {
    "batch_norm_hardtanh": _batch_norm_hardtanh,
    "batch_norm_hardtanh_grad": _batch_norm_hardtanh_grad,
    "batch_norm_apply": _batch_norm_apply,
}
