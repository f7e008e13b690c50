"""The ONNX kernel of ``dequantize`` in standard opset-18 operators.

``DequantizeLinear`` takes one scale per tensor or per axis (opset 18; blocked scales
came in opset 21) and no float offset, so group-wise codes are written out as what it
computes: 4-bit codes split with ``BitwiseAnd``/``BitShift`` on the u8 bytes and
concatenated in GGUF's order, ``Cast`` to float, groups viewed as ``[..., C/group,
group]``, times the scale (plus the offset, or minus 8 for ``int4_sym``).
"""

from __future__ import annotations

from pockengine.backends.onnx.emitter import Emitter, Kernel, onnx_dtype, registrar
from pockengine.backends.onnx.kernels_loss import KERNELS as LOSS
from pockengine.ir import DType, Node, TensorType, Value
from pockengine.ops.quant_loss import LOWBIT_LOSS, split_inputs

__all__ = ["KERNELS"]

KERNELS: dict[str, Kernel] = {}
_k = registrar(KERNELS)


@_k("dequantize")
def _dequantize(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    _matrix(em, node, x, node.output.type, out[0])


@_k("dequantize_matmul")
def _dequantize_matmul(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
    """The C backend's fused product, unfused: dequantize, then MatMul (W or W^T)."""
    codes_t, result = node.inputs[1].type, node.output.type
    cols = codes_t.shape[-1] * (1 if node.attrs["scheme"] == "int8" else 2)
    w = _matrix(em, node, x[1:], TensorType((*codes_t.shape[:-1], cols), result.dtype), None)
    if node.attrs["transpose"]:
        w = em.op("Transpose", w, perm=[1, 0])
    em.op("MatMul", x[0], w, out=out[0])


def _matrix(em: Emitter, node: Node, x: list[str], result: TensorType, out: str | None) -> str:
    """The float tensor of the codes, scales and offsets ``x`` (of ``node``'s attributes)."""
    scheme, group = str(node.attrs["scheme"]), int(str(node.attrs["group"]))
    first = 1 if node.op == "dequantize_matmul" else 0
    codes_t = node.inputs[first].type
    lead, cols = codes_t.shape[:-1], result.shape[-1]
    q = x[0]
    if scheme != "int8":
        g = em.op("Reshape", q, em.ints([*lead, cols // group, group // 2]))
        low = em.op("BitwiseAnd", g, em.scalar(0x0F, DType.U8))
        high = em.op("BitShift", g, em.scalar(4, DType.U8), direction="RIGHT")
        q = em.op("Concat", low, high, axis=-1)
    w = em.op(
        "Cast",
        em.op("Reshape", q, em.ints([*lead, cols // group, group])),
        to=onnx_dtype(result.dtype),
    )
    if scheme == "int4_sym":
        w = em.op("Sub", w, em.scalar(8.0, result.dtype))
    axis = em.ints([-1])
    scales = _as(em, x[1], node.inputs[first + 1].dtype, result.dtype)
    w = em.op("Mul", w, em.op("Unsqueeze", scales, axis))
    if len(x) > 2:
        offsets = _as(em, x[2], node.inputs[first + 2].dtype, result.dtype)
        w = em.op("Add", w, em.op("Unsqueeze", offsets, axis))
    return em.op("Reshape", w, em.ints(result.shape), out=out)


def _as(em: Emitter, x: str, dtype: DType, want: DType) -> str:
    return x if dtype is want else em.op("Cast", x, to=onnx_dtype(want))


def _lowbit_loss(base: str) -> Kernel:
    """``dequantize_<base>`` (ops/quant_loss.py): the matrix made, then ``base``'s kernel."""
    at = LOWBIT_LOSS[base][1]

    def kernel(em: Emitter, node: Node, x: list[str], out: list[str]) -> None:
        head, quantized = split_inputs(base, node.inputs)
        names, qnames = split_inputs(base, tuple(x))
        cols = quantized[0].shape[-1] * (1 if node.attrs["scheme"] == "int8" else 2)
        w_type = TensorType((*quantized[0].shape[:-1], cols), node.outputs[0].dtype)
        probe = Node("dequantize", tuple(quantized), (Value("w", w_type),), node.attrs)
        names[at] = _matrix(em, probe, qnames, w_type, None)
        head[at] = Value(names[at], w_type)
        LOSS[base](em, node.replace(op=base, inputs=tuple(head)), names, out)

    return kernel


for _base in (
    "linear_log_softmax_gather",
    "linear_log_softmax_gather_grad",
    "linear_log_softmax_gather_with_grad",
):
    KERNELS[f"dequantize_{_base}"] = _lowbit_loss(_base)
