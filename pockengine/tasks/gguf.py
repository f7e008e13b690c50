"""GGUF weights as they are: Q4_0, Q4_1 and Q8_0 blocks become ``dequantize`` inputs.

A GGUF tensor of one of these types is rows of 32-element blocks: an f16 scale ``d``
(Q4_1: then an f16 minimum ``m``) followed by the codes, 16 bytes of nibbles (element
``j`` low, ``j + 16`` high) or 32 int8. ``decode_blocks`` splits the blocks into the
codes, scales and offsets of ``pockengine.ops.quant`` without converting a single value:
Q4_1 -> ``int4`` (w = d * q + m), Q4_0 -> ``int4_sym`` (w = d * (q - 8)), Q8_0 -> ``int8``
(w = d * q), group 32, f16 scales. ``llama_weights`` reads a LLaMA GGUF file (the file is
memory-mapped by ``gguf.GGUFReader``; only metadata and the blocks are read, nothing is
executed) and names its quantized matrices as ``LlamaForCausalLM`` does, undoing the
row permutation llama.cpp's converter applies to the query and key projections, as
transformers does when it loads the same file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.ir.arrays import Array
from pockengine.ops.quant import Quantized
from pockengine.passes.quantize import AS_GIVEN, FrozenWeights
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = ["BLOCK", "FORMATS", "decode_blocks", "frozen_weights", "llama_weights"]
BLOCK = 32  # elements per block in Q4_0, Q4_1 and Q8_0
# GGML type name -> (our scheme, block bytes, f16 fields before the codes)
FORMATS = {"Q4_0": ("int4_sym", 18, 1), "Q4_1": ("int4", 20, 2), "Q8_0": ("int8", 34, 1)}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def decode_blocks(data: Array, kind: str, shape: tuple[int, int]) -> Quantized:
    """The ``[rows, cols]`` tensor stored as ``data`` (uint8 bytes, ``rows`` x blocks) in
    GGML type ``kind``, as codes and f16 scales (and offsets) without dequantizing."""
    if kind not in FORMATS:
        raise FinetuneError(f"GGUF type {kind} is not one of {sorted(FORMATS)}")
    scheme, size, fields = FORMATS[kind]
    rows, cols = shape
    if cols % BLOCK or data.dtype != np.uint8 or data.size != rows * cols // BLOCK * size:
        raise FinetuneError(f"{data.dtype}{list(data.shape)} is not {kind} blocks of {shape}")
    blocks = np.ascontiguousarray(data).reshape(rows, cols // BLOCK, size)
    head = blocks[..., : 2 * fields].copy().view(np.float16)  # [rows, blocks, fields]
    codes = np.ascontiguousarray(blocks[..., 2 * fields :]).reshape(rows, -1)
    if scheme == "int8":
        codes = codes.view(np.int8)
    offsets = head[..., 1].copy() if fields == 2 else None
    return Quantized(codes, head[..., 0].copy(), offsets, scheme, BLOCK)


def _rows_permuted(q: Quantized, heads: int) -> Quantized:
    """Undo llama.cpp's interleaving of the rotary halves of each head's rows."""

    def unpermute(a: Array) -> Array:
        dim = a.shape[0] // heads // 2
        return np.ascontiguousarray(
            a.reshape(heads, dim, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)
        )

    offsets = None if q.offsets is None else unpermute(q.offsets)
    return Quantized(unpermute(q.codes), unpermute(q.scales), offsets, q.scheme, q.group)


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def llama_weights(path: Path) -> dict[str, Quantized]:
    """The Q4_0/Q4_1/Q8_0 matrices of a LLaMA GGUF file, by ``LlamaForCausalLM`` name; a
    ``FinetuneError`` naming the file when it is truncated, corrupt or not a LLaMA GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        heads = _field(reader, "llama.attention.head_count")
        kv_heads = _field(reader, "llama.attention.head_count_kv")
        return _matrices(reader, heads, kv_heads)
    except FinetuneError as exc:
        raise FinetuneError(f"{path}: {exc}") from exc
    except Exception as exc:  # the gguf reader fails in many ways on bad bytes; the file is why
        why = f"{type(exc).__name__}: {exc}"
        raise FinetuneError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {why}"
        ) from exc


def _matrices(reader: Any, heads: int, kv_heads: int) -> dict[str, Quantized]:
    out: dict[str, Quantized] = {}
    for t in reader.tensors:
        name, kind = _hf_name(t.name), t.tensor_type.name
        if name is None or kind not in FORMATS or len(t.shape) != 2:
            continue
        cols, rows = (int(d) for d in t.shape)  # GGUF lists the fastest axis first
        q = decode_blocks(np.asarray(t.data), kind, (rows, cols))
        if ".q_proj." in name or ".k_proj." in name:
            q = _rows_permuted(q, heads if ".q_proj." in name else kv_heads)
        out[name] = q
    return out


def _field(reader: Any, key: str) -> int:
    field = reader.fields.get(key)
    if field is None:
        raise FinetuneError(f"the GGUF file has no {key}")
    value = int(field.parts[field.data[0]][0])
    if value <= 0:
        raise FinetuneError(f"{key} is {value}; expected a positive count")
    return value


def frozen_weights(config: FinetuneConfig) -> FrozenWeights:
    """How a fine-tuning run stores its frozen weights (``--frozen-dtype``): as the model
    has them ("none"), quantized at compile time ("int8", "int4"), or the GGUF blocks the
    recipe's model ships, as they are ("gguf"; smollm2-pydocs)."""
    if config.frozen_dtype == "none":
        return AS_GIVEN
    if config.frozen_dtype != "gguf":
        return FrozenWeights(config.frozen_dtype)
    own = str(config.model or "")
    if config.recipe is None and own.lower().endswith(".gguf"):
        return FrozenWeights(None, llama_weights(_llama_file(Path(own))))
    if config.recipe != "smollm2-pydocs":
        raise FinetuneError(
            "--frozen-dtype gguf takes the blocks of a model shipped as GGUF (a --model "
            "FILE.gguf, or the smollm2-pydocs recipe's); for "
            f"{config.recipe or config.model} use int8 or int4"
        )
    from pockengine.tasks.causal_lm import smollm2_gguf

    return FrozenWeights(None, llama_weights(smollm2_gguf()))


def _llama_file(path: Path) -> Path:
    """``path``, a LLaMA-architecture GGUF file (whose blocks ``llama_weights`` reads)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (OSError, ValueError, KeyError) as e:
        raise FinetuneError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    if arch != "llama":
        raise FinetuneError(
            f"{path}: --frozen-dtype gguf reads the blocks of LLaMA GGUF "
            f"files; this one is {arch!r}: use int8 or int4"
        )
    return path
