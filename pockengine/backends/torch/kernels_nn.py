"""The torch kernel table, part three: matmul, convolution, pooling, normalisation, updates.

Backward kernels call ATen's own backward ops (``convolution_backward``,
``native_batch_norm_backward``, ...). Where one wants a tensor only for its shape
(the weight of a weight gradient) it gets a one-element compile-time constant
expanded to that shape. Nodes ATen computes together are paired (``FINDERS``): max
pooling hands its backward the argmax indices, batch norm its 1/std, a convolution's
input gradient the weight gradient of the same ``gy``. Batch norm's forward kernel, which
can take over its running statistics' updates, is in ``kernels_stats``.

Update ops write the param and the optimizer state in place, each in one pass (ATen's
fused SGD and AdamW kernels, ``addcmul_``, ``copy_``), so the tensors in the store keep
their storage from step to step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, GraphIndex, PairFinder, literal
from pockengine.backends.torch.kernels import slot_copies, torch_dtype
from pockengine.backends.torch.serial import Probes, serial_call
from pockengine.ir import Node

__all__ = ["FINDERS", "KERNELS", "NAMESPACE"]

_aten = torch.ops.aten


def _geometry(e: Emit) -> str:
    keys = ("stride", "padding", "dilation")
    return ", ".join(literal(tuple(e.attr(k))) for k in keys)


def _shape_only(e: Emit, shape: tuple[int, ...]) -> str:
    """A global standing for a tensor of ``shape`` whose values the kernel never reads: one
    element expanded (as ``torch.nn.grad`` does)."""
    dtype = torch_dtype(e.node.inputs[0].dtype)
    return e.const(torch.zeros(1, dtype=dtype, device=e.device).expand(shape))


# -- linear algebra and convolution ----------------------------------------------------------
def _matmul(e: Emit) -> list[str]:
    x, y = e.ins
    rank = e.node.output.type.rank
    swap = (*range(rank - 2), rank - 1, rank - 2)
    readers = e.readers()
    matrices = rank == 2 and all(v.type.rank == 2 for v in e.node.inputs)
    if len(readers) == 1 and readers[0].op == "transpose" and readers[0].attrs["perm"] == swap:
        # Its only reader transposes it (a weight gradient): computed as (y^T x^T)^T, which
        # BLAS does as cheaply, the transpose is contiguous instead of a strided view.
        m, n = e.node.output.shape[-2:]
        dest = e.dest((n, m)) if matrices else None
        if dest is not None:
            return [f"{e.out} = aten_mm({y}.mT, {x}.mT, out={dest}).mT"]
        return [f"{e.out} = aten_matmul({y}.mT, {x}.mT).mT"]
    dest = e.dest() if matrices else None  # mm into the slot: the kernel matmul runs
    if dest is not None:
        return [f"{e.out} = aten_mm({x}, {y}, out={dest})"]
    return [f"{e.out} = aten_matmul({x}, {y})"]


def _linear(e: Emit) -> list[str]:
    """x @ w + b as one addmm (BLAS adds the bias while writing the product); a batched x
    is viewed as a matrix."""
    x, w, b = e.ins
    xv = e.node.inputs[0]
    rows = math.prod(e.node.output.shape[:-1])
    dest = e.dest((rows, e.node.output.shape[-1]))  # a workspace slot, viewed as the matrix
    out = "" if dest is None else f", out={dest}"
    if xv.type.rank == 2:
        return [f"{e.out} = aten_addmm({b}, {x}, {w}{out})"]
    shape = literal(e.node.output.shape)
    flat = f"{x}.reshape(-1, {xv.shape[-1]})"
    return [f"{e.out} = aten_addmm({b}, {flat}, {w}{out}).view({shape})"]


def _conv2d(e: Emit) -> list[str]:
    x, w, *b = e.ins
    bias = b[0] if b else "None"
    args = f"{x}, {w}, {bias}, {_geometry(e)}, {e.attr('groups')}"
    return [f"{e.out} = aten_conv2d({args})"]


def _conv2d_input_grad(e: Emit) -> list[str]:
    """With the weight gradient of the same gy paired (``_conv_partner``): one
    convolution_backward computing both. Alone: a transposed convolution, since
    convolution_backward wants the input itself (a shape-only stand-in sends depthwise
    convolutions down a slow path)."""
    gy, w = e.ins
    x = e.local(e.partner.inputs[0]) if e.partner is not None else None
    if e.saved and x:
        args = f"{gy}, {x}, {w}, None, {_geometry(e)}, False, (0, 0), {e.attr('groups')}"
        call = f"aten_convolution_backward({args}, (True, True, False))"
        return [f"{e.out}, {e.saved}, _ = {call}"]
    stride, padding, dilation = (tuple(e.attr(k)) for k in ("stride", "padding", "dilation"))
    kernel, out = e.node.inputs[1].shape[2:], e.node.inputs[0].shape[2:]
    size = tuple(e.attr("x_shape"))[2:]
    # output_padding: the rows and columns past the last window (fewer than the stride)
    extra = tuple(
        size[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1 - (out[i] - 1) * stride[i]
        for i in range(2)
    )
    args = f"{literal(stride)}, {literal(padding)}, {literal(extra)}, {e.attr('groups')}"
    return [f"{e.out} = aten_conv_transpose2d({gy}, {w}, None, {args}, {literal(dilation)})"]


def _conv2d_weight_grad(e: Emit) -> list[str]:
    if e.saved:  # computed with the input gradient
        return [f"{e.out} = {e.saved}"]
    x, gy = e.ins
    w = _shape_only(e, tuple(e.attr("w_shape")))
    args = f"{gy}, {x}, {w}, None, {_geometry(e)}, False, (0, 0), {e.attr('groups')}"
    return [f"{e.out} = aten_convolution_backward({args}, (False, True, False))[1]"]


_CONV_GEOMETRY = ("stride", "padding", "dilation", "groups")


def _conv_partner(node: Node, index: GraphIndex) -> Node | None:
    """The conv2d_input_grad of the same gy and convolution, for a conv2d_weight_grad, if
    the input x is made before it (the pair is computed at the input gradient's line)."""
    x, gy = node.inputs
    for user in index.users.get(gy.name, []):
        if (
            user.op == "conv2d_input_grad"
            and user.inputs[0] == gy
            and index.made_at.get(x.name, -1) < index.made_at[user.outputs[0].name]
            and user.inputs[1].shape == node.output.shape
            and user.attrs["x_shape"] == x.shape
            and all(user.attrs[k] == node.attrs[k] for k in _CONV_GEOMETRY)
        ):
            return user
    return None


# -- pooling ---------------------------------------------------------------------------------
_MAX_KEYS = ("kernel", "stride", "padding", "dilation", "ceil_mode")
_AVG_KEYS = ("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _attrs(e: Emit, keys: tuple[str, ...]) -> str:
    return ", ".join(literal(e.attr(k)) for k in keys)


def _max_pool2d(e: Emit) -> list[str]:
    args = f"{e.ins[0]}, {_attrs(e, _MAX_KEYS)}"
    if e.saved:  # the backward kernel reads the argmax indices
        return [f"{e.out}, {e.saved} = aten_max_pool2d_with_indices({args})"]
    return [f"{e.out} = aten_max_pool2d({args})"]


def _max_pool2d_grad(e: Emit) -> list[str]:
    gy, x = e.ins
    attrs = _attrs(e, _MAX_KEYS)
    stmts = []
    indices = e.saved
    if indices is None:
        indices = e.tmp()
        stmts.append(f"{indices} = aten_max_pool2d_with_indices({x}, {attrs})[1]")
    call = f"aten_max_pool2d_with_indices_backward({gy}, {x}, {attrs}, {indices})"
    return [*stmts, f"{e.out} = {call}"]


def _pool_partner(node: Node, index: GraphIndex) -> Node | None:
    """The max_pool2d of the same input and attributes, whose indices a grad can reuse."""
    x = node.inputs[1]
    for user in index.users.get(x.name, []):
        if user.op == "max_pool2d" and user.inputs[0] == x and user.attrs == node.attrs:
            return user
    return None


def _avg_pool2d(e: Emit) -> list[str]:
    return [f"{e.out} = aten_avg_pool2d({e.ins[0]}, {_attrs(e, _AVG_KEYS)})"]


def _avg_pool2d_grad(e: Emit) -> list[str]:
    x = _shape_only(e, tuple(e.attr("x_shape")))
    return [f"{e.out} = aten_avg_pool2d_backward({e.ins[0]}, {x}, {_attrs(e, _AVG_KEYS)})"]


# -- normalisation ---------------------------------------------------------------------------
def _batch_norm_grad(e: Emit) -> list[str]:
    gy, x, w, mean, var = e.ins
    eps = literal(float(e.attr("eps")))
    invstd = e.saved or f"aten_rsqrt(aten_add({var}, {eps}))"
    mask = literal(e.used)
    args = f"{gy}, {x}, {w}, None, None, {mean}, {invstd}, True, {eps}, {mask}"
    call = serial_call(e, "aten_native_batch_norm_backward", args, Probes.batch_norm_grad)
    return [f"{', '.join(e.outs)} = {call}"]


def _bn_partner(node: Node, index: GraphIndex) -> Node | None:
    """The batch_norm whose variance (and eps) this grad reads: its 1/std is reusable."""
    made = index.producers.get(node.inputs[4].name)
    if made is None or made.op != "batch_norm" or made.attrs["eps"] != node.attrs["eps"]:
        return None
    return made if made.outputs[2] == node.inputs[4] else None


def _normalized_shape(e: Emit) -> str:
    x = e.node.inputs[0] if e.node.op == "layer_norm" else e.node.inputs[1]
    ndim = int(e.attr("ndim"))
    return literal(x.shape[x.type.rank - ndim :])


def _layer_norm(e: Emit) -> list[str]:
    x, w, b = e.ins
    eps = literal(float(e.attr("eps")))
    args = f"{x}, {_normalized_shape(e)}, {w}, {b}, {eps}"
    dest = e.dest()
    if dest is None:
        return [f"{', '.join(e.outs)} = aten_native_layer_norm({args})"]
    # y into its workspace slot; the statistics (a value per row) are allocated
    stat = e.node.outputs[1]
    fresh = f"aten_empty({literal(stat.shape)}, dtype={e.dtype(stat.dtype)}, device=dev)"
    outs = f"out0={dest}, out1={fresh}, out2={fresh}"
    return [f"{', '.join(e.outs)} = aten_native_layer_norm_out({args}, {outs})"]


def _layer_norm_grad(e: Emit) -> list[str]:
    gy, x, w, mean, rstd = e.ins
    # The bias argument only gives the bias gradient's shape and dtype: w's.
    args = f"{gy}, {x}, {_normalized_shape(e)}, {mean}, {rstd}, {w}, {w}, {literal(e.used)}"
    # gx copied into its workspace slot, if it has one: the ``out=`` overload would insist
    # on computing the weight and bias gradients too (2.4x the time)
    return [f"{', '.join(e.outs)} = aten_native_layer_norm_backward({args})", *slot_copies(e)]


# -- updates (in place) ----------------------------------------------------------------------
def _trained_part(e: Emit, stmts: list[str]) -> str:
    """The param, or the view of its first ``rows`` rows that a partial update writes."""
    rows = e.get("rows")
    if rows is None:
        return e.ins[0]
    part = e.tmp()
    stmts.append(f"{part} = {e.ins[0]}.narrow(0, 0, {int(rows)})")
    return part


def _direction(e: Emit, w: str, g: str, stmts: list[str]) -> str:
    """d = g + weight_decay * w."""
    decay = float(e.attr("weight_decay"))
    if not decay:
        return g
    d = e.tmp()
    stmts.append(f"{d} = aten_add({g}, {w}, alpha={literal(decay)})")
    return d


def _skip(e: Emit, position: int) -> str:
    """The optional ``skip`` flag (1.0: a non-finite step, write nothing) as the fused
    kernels' ``found_inf`` argument, or nothing."""
    return f", found_inf={e.ins[position]}" if len(e.ins) > position else ""


def _nonfinite(e: Emit) -> list[str]:
    return [f"{e.outs[0]} = aten_nonfinite({e.ins[0]})"]


def _assign(e: Emit) -> list[str]:
    dst, src = e.ins[0], e.ins[1]
    if len(e.ins) > 2:  # a skipped step leaves dst as it is
        return [f"gated_copy_({dst}, {src}, {e.ins[2]})"]
    return [f"{dst}.copy_({src})"]


def _sgd_update(e: Emit) -> list[str]:
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, lr = e.ins[1], e.ins[2]
    if len(e.ins) > 3:  # ATen's fused SGD without momentum skips on found_inf
        args = (
            f"[{w}], [laid_out_as({g}, {w})], []"
            f", weight_decay={literal(float(e.attr('weight_decay')))}, momentum=0.0, lr={lr}"
            ", dampening=0.0, nesterov=False, maximize=False, is_first_step=False"
        )
        return [*stmts, serial_call(e, "aten_fused_sgd_", args + _skip(e, 3), Probes.fused_sgd)]
    d = _direction(e, w, g, stmts)
    return [*stmts, f"{w}.addcmul_({d}, {lr}, value=-1)"]


def _laid_out_as(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g`` with the strides of ``w`` (a dense param): the fused kernels index raw memory."""
    return g if g.stride() == w.stride() else torch.empty_like(w).copy_(g)


def _gated_copy(dst: torch.Tensor, src: torch.Tensor, skip: torch.Tensor) -> None:
    """dst <- src unless skip != 0. On the CPU the flag is read directly (a ``where`` per
    buffer costs ~20 us, 156 of them in MobileNetV2's batch norms); elsewhere a ``where``
    keeps the step free of host reads."""
    if skip.device.type == "cpu":
        if not skip.item():
            dst.copy_(src)
    else:
        dst.copy_(torch.where(skip != 0, dst, src))


def _nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """1.0 when ``x`` holds a NaN or an inf, else 0.0 (f32, on x's device: no host read)."""
    return torch.isfinite(x).all().logical_not().to(torch.float32)


def _sgd_momentum_update(e: Emit) -> list[str]:
    """ATen's fused SGD (one pass; dampening 0, and a zero buffer makes step 1 buf = d)."""
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, buf, lr = e.ins[1:4]
    args = (
        f"[{w}], [laid_out_as({g}, {w})], [{buf}]"
        f", weight_decay={literal(float(e.attr('weight_decay')))}"
        f", momentum={literal(float(e.attr('momentum')))}, lr={lr}, dampening=0.0"
        f", nesterov={bool(e.attr('nesterov'))}, maximize=False, is_first_step=False"
    )
    return [*stmts, serial_call(e, "aten_fused_sgd_", args + _skip(e, 4), Probes.fused_sgd)]


def _adamw_update(e: Emit) -> list[str]:
    """ATen's fused AdamW (one pass over w, g, m, v; the step count t is read from a tensor).
    Its kernel indexes raw memory, so the gradient is laid out as the param first."""
    stmts: list[str] = []
    w = _trained_part(e, stmts)
    g, m, v, t, lr = e.ins[1:6]
    hyper = ", ".join(
        f"{k}={literal(float(e.attr(k)))}" for k in ("beta1", "beta2", "weight_decay", "eps")
    )
    args = f"[{w}], [laid_out_as({g}, {w})], [{m}], [{v}], [], [{t}], lr={lr}, {hyper}"
    args += f", amsgrad=False, maximize=False{_skip(e, 6)}"
    return [*stmts, serial_call(e, "aten_fused_adamw_", args, Probes.fused_adamw)]


# -- the table -------------------------------------------------------------------------------
KERNELS: dict[str, Emitter] = {
    "matmul": _matmul,
    "linear": _linear,
    "conv2d": _conv2d,
    "conv2d_input_grad": _conv2d_input_grad,
    "conv2d_weight_grad": _conv2d_weight_grad,
    "max_pool2d": _max_pool2d,
    "max_pool2d_grad": _max_pool2d_grad,
    "avg_pool2d": _avg_pool2d,
    "avg_pool2d_grad": _avg_pool2d_grad,
    "batch_norm_grad": _batch_norm_grad,
    "layer_norm": _layer_norm,
    "layer_norm_grad": _layer_norm_grad,
    "nonfinite": _nonfinite,
    "assign": _assign,
    "sgd_update": _sgd_update,
    "sgd_momentum_update": _sgd_momentum_update,
    "adamw_update": _adamw_update,
}

FINDERS: dict[str, PairFinder] = {
    "conv2d_weight_grad": _conv_partner,
    "max_pool2d_grad": _pool_partner,
    "batch_norm_grad": _bn_partner,
}

NAMESPACE: dict[str, Callable[..., Any]] = {
    "aten_matmul": torch.matmul,
    "aten_mm": torch.mm,
    "aten_addmm": torch.addmm,
    "aten_conv2d": torch.conv2d,
    "aten_conv_transpose2d": torch.conv_transpose2d,
    "aten_convolution_backward": _aten.convolution_backward.default,
    "aten_max_pool2d": torch.max_pool2d,
    "aten_max_pool2d_with_indices": torch._C._nn.max_pool2d_with_indices,
    "aten_max_pool2d_with_indices_backward": _aten.max_pool2d_with_indices_backward.default,
    "aten_avg_pool2d": torch._C._nn.avg_pool2d,
    "aten_avg_pool2d_backward": _aten.avg_pool2d_backward.default,
    "aten_native_batch_norm": torch.native_batch_norm,
    "aten_native_batch_norm_backward": _aten.native_batch_norm_backward.default,
    "aten_native_layer_norm": torch.native_layer_norm,
    "aten_native_layer_norm_out": _aten.native_layer_norm.out,
    "aten_empty": torch.empty,
    "aten_native_layer_norm_backward": _aten.native_layer_norm_backward.default,
    "aten_rsqrt": torch.rsqrt,
    "aten_add": torch.add,
    "aten_fused_sgd_": torch._fused_sgd_,
    "laid_out_as": _laid_out_as,
    "aten_nonfinite": _nonfinite_flag,
    "gated_copy_": _gated_copy,
    "aten_fused_adamw_": torch._fused_adamw_,
}
