"""The torch kernels of ``layout_convert`` (``ops/layout.py``), the NHWC convolutions
(``ops/conv_nhwc.py``) and the channel-blocked ones (``ops/conv_blocked.py``).

Only the C backend's layout pass makes these ops; here each is one call of a helper over
ATen (a permutation, or the NCHW convolution between permutations), so a graph holding
them (an op-table test, a rewritten graph) runs on torch too.
"""

from __future__ import annotations

from typing import Any

import torch

from pockengine.backends.torch.codegen import Emit, Emitter, literal

__all__ = ["KERNELS", "NAMESPACE"]

_aten = torch.ops.aten
_TO_NCHW = (0, 3, 1, 2)
_TO_NHWC = (0, 2, 3, 1)


def _block(layout: str) -> int:
    return 0 if layout == "NCHW" else -1 if layout == "NHWC" else int(layout[4:-1])


def layout_convert(x: torch.Tensor, src: str, dst: str, channels: int) -> torch.Tensor:
    """``x`` laid out as ``src`` -> the same activation laid out as ``dst`` (a contiguous
    copy, never a view of ``x``)."""
    given = x
    block = _block(src)
    if block < 0:
        x = x.permute(_TO_NCHW)
    elif block > 0:
        n, blocks, h, w, c = x.shape
        x = x.permute(0, 1, 4, 2, 3).reshape(n, blocks * c, h, w)[:, :channels]
    block = _block(dst)
    if block < 0:
        x = x.permute(_TO_NHWC)
    elif block > 0:
        n, c, h, w = x.shape
        blocks = -(-c // block)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, blocks * block - c))
        x = x.reshape(n, blocks, block, h, w).permute(0, 1, 3, 4, 2)
    x = x.contiguous()
    return x.clone() if x.untyped_storage().data_ptr() == given.untyped_storage().data_ptr() else x


def _stand_in(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(1, dtype=like.dtype, device=like.device).expand(shape)


def conv2d_nhwc(x: torch.Tensor, w: torch.Tensor, b: Any, *geometry: Any) -> torch.Tensor:
    y = torch.conv2d(x.permute(_TO_NCHW), w, b, *geometry)
    return y.permute(_TO_NHWC).contiguous()


def conv2d_nhwc_input_grad(
    gy: torch.Tensor, w: torch.Tensor, x_shape: tuple[int, ...], *geometry: Any
) -> torch.Tensor:
    stride, padding, dilation, groups = geometry
    x = _stand_in(gy, tuple(x_shape[p] for p in _TO_NCHW))
    args = (gy.permute(_TO_NCHW), x, w, None, stride, padding, dilation, False, (0, 0), groups)
    gx = _aten.convolution_backward.default(*args, (True, False, False))[0]
    result: torch.Tensor = gx.permute(_TO_NHWC).contiguous()
    return result


def conv2d_nhwc_weight_grad(
    x: torch.Tensor, gy: torch.Tensor, w_shape: tuple[int, ...], *geometry: Any
) -> torch.Tensor:
    stride, padding, dilation, groups = geometry
    w = _stand_in(x, w_shape)
    args = (gy.permute(_TO_NCHW), x.permute(_TO_NCHW), w, None, stride, padding, dilation)
    grads = _aten.convolution_backward.default(*args, False, (0, 0), groups, (False, True, False))
    gw: torch.Tensor = grads[1]
    return gw


def _blocked(x: torch.Tensor, block: int, channels: int) -> torch.Tensor:
    return layout_convert(x, f"NCHW{block}c", "NCHW", channels)


def _to_blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    return layout_convert(x, "NCHW", f"NCHW{block}c", x.shape[1])


def conv2d_nchwc(
    x: torch.Tensor, w: torch.Tensor, b: Any, block: int, *geometry: Any
) -> torch.Tensor:
    y = torch.conv2d(_blocked(x, block, w.shape[1] * geometry[3]), w, b, *geometry)
    return _to_blocked(y, block)


def conv2d_nchwc_input_grad(
    gy: torch.Tensor, w: torch.Tensor, x_shape: tuple[int, ...], block: int, *geometry: Any
) -> torch.Tensor:
    stride, padding, dilation, groups = geometry
    x = _stand_in(gy, tuple(x_shape))
    args = (_blocked(gy, block, w.shape[0]), x, w, None, stride, padding, dilation, False)
    gx = _aten.convolution_backward.default(*args, (0, 0), groups, (True, False, False))[0]
    return _to_blocked(gx, block)


def conv2d_nchwc_weight_grad(
    x: torch.Tensor, gy: torch.Tensor, w_shape: tuple[int, ...], block: int, *geometry: Any
) -> torch.Tensor:
    stride, padding, dilation, groups = geometry
    w = _stand_in(x, w_shape)
    xn = _blocked(x, block, w_shape[1] * groups)
    args = (_blocked(gy, block, w_shape[0]), xn, w, None, stride, padding, dilation)
    grads = _aten.convolution_backward.default(*args, False, (0, 0), groups, (False, True, False))
    gw: torch.Tensor = grads[1]
    return gw


def _geometry(e: Emit) -> str:
    return ", ".join(literal(e.attr(k)) for k in ("stride", "padding", "dilation", "groups"))


def _layout_convert(e: Emit) -> list[str]:
    attrs = ", ".join(literal(e.attr(k)) for k in ("src", "dst", "channels"))
    return [f"{e.out} = pe_layout_convert({e.ins[0]}, {attrs})"]


def _conv2d_nhwc(e: Emit) -> list[str]:
    x, w, *b = e.ins
    return [f"{e.out} = pe_conv2d_nhwc({x}, {w}, {b[0] if b else 'None'}, {_geometry(e)})"]


def _conv2d_nhwc_input_grad(e: Emit) -> list[str]:
    gy, w = e.ins
    shape = literal(tuple(e.attr("x_shape")))
    return [f"{e.out} = pe_conv2d_nhwc_input_grad({gy}, {w}, {shape}, {_geometry(e)})"]


def _conv2d_nhwc_weight_grad(e: Emit) -> list[str]:
    x, gy = e.ins
    shape = literal(tuple(e.attr("w_shape")))
    return [f"{e.out} = pe_conv2d_nhwc_weight_grad({x}, {gy}, {shape}, {_geometry(e)})"]


def _conv2d_nchwc(e: Emit) -> list[str]:
    x, w, *b = e.ins
    bias, block = b[0] if b else "None", literal(e.attr("block"))
    return [f"{e.out} = pe_conv2d_nchwc({x}, {w}, {bias}, {block}, {_geometry(e)})"]


def _conv2d_nchwc_input_grad(e: Emit) -> list[str]:
    gy, w = e.ins
    shape, block = literal(tuple(e.attr("x_shape"))), literal(e.attr("block"))
    return [f"{e.out} = pe_conv2d_nchwc_input_grad({gy}, {w}, {shape}, {block}, {_geometry(e)})"]


def _conv2d_nchwc_weight_grad(e: Emit) -> list[str]:
    x, gy = e.ins
    shape, block = literal(tuple(e.attr("w_shape"))), literal(e.attr("block"))
    return [f"{e.out} = pe_conv2d_nchwc_weight_grad({x}, {gy}, {shape}, {block}, {_geometry(e)})"]


KERNELS: dict[str, Emitter] = {
    "layout_convert": _layout_convert,
    "conv2d_nhwc": _conv2d_nhwc,
    "conv2d_nhwc_input_grad": _conv2d_nhwc_input_grad,
    "conv2d_nhwc_weight_grad": _conv2d_nhwc_weight_grad,
    "conv2d_nchwc": _conv2d_nchwc,
    "conv2d_nchwc_input_grad": _conv2d_nchwc_input_grad,
    "conv2d_nchwc_weight_grad": _conv2d_nchwc_weight_grad,
}

NAMESPACE: dict[str, Any] = {
    "pe_layout_convert": layout_convert,
    "pe_conv2d_nhwc": conv2d_nhwc,
    "pe_conv2d_nhwc_input_grad": conv2d_nhwc_input_grad,
    "pe_conv2d_nhwc_weight_grad": conv2d_nhwc_weight_grad,
    "pe_conv2d_nchwc": conv2d_nchwc,
    "pe_conv2d_nchwc_input_grad": conv2d_nchwc_input_grad,
    "pe_conv2d_nchwc_weight_grad": conv2d_nchwc_weight_grad,
}
