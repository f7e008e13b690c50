"""LoRA adapters as llama.cpp loads them: a GGUF adapter file written with ``gguf``.

``write_gguf_lora(adapter, path, heads=, kv_heads=)`` turns a PEFT adapter (the
``RUN/adapter`` a LoRA run writes, ``finetune/run_folder/adapter.py``) into the file that
``llama-cli --lora FILE`` and ``llama-export-lora`` take, as llama.cpp's own
``convert_lora_to_gguf.py`` lays it out:

- metadata ``general.architecture`` (llama.cpp's name of the model's architecture, which
  must be the base GGUF's: ``llama`` for LLaMA, Mistral and SmolLM, ``qwen2``, ``qwen3``),
  ``general.type = adapter``, ``adapter.type = lora`` and ``adapter.lora.alpha``, a float32
  (one alpha for the file: llama.cpp scales each pair by ``alpha / r`` with ``r`` the
  pair's own rank; a pair whose PEFT scale is another, an alpha that differs per module or
  rsLoRA's ``alpha / sqrt(r)``, has its B factor rescaled to give the same product);
- for each adapted weight, named as in a LLaMA GGUF (``blk.N.attn_q.weight``...),
  ``<name>.lora_a`` = PEFT's ``lora_A`` ``[r, in]`` and ``<name>.lora_b`` = ``lora_B``
  ``[out, r]``, float32 (GGUF lists the fastest axis first: ``[in, r]`` and ``[r, out]``);
- for LLaMA-family models, the rows of the query and key projections' B factors permuted
  as llama.cpp's converter permutes those weights' rows (each head's rotary halves
  interleaved), the inverse of what ``tasks/gguf.py`` undoes when it reads a GGUF model;
  Qwen2 and Qwen3 weights keep Hugging Face's order there.

An adapter that trains anything besides LoRA factors (PEFT's ``modules_to_save``: a head,
norms), a DoRA adapter, LoRA on a head tied to the embedding (the GGUF has no
``output.weight``) and an architecture not in ``ARCHITECTURES`` have no place in
llama.cpp's adapter format, and are refused. ``tools/llamacpp.py`` builds llama.cpp and
checks a run's adapter against it (``tests/test_llamacpp_adapter.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.finetune.run_folder.adapter import PEFT_PREFIX, _read_config, _read_safetensors
from pockengine.ir.arrays import Array
from pockengine.tasks.config import FinetuneError
from pockengine.tasks.gguf import _LAYER_NAMES, _TOP_NAMES

__all__ = [
    "ADAPTER_TARGETS",
    "ARCHITECTURES",
    "GgufLora",
    "export_run_adapter",
    "gguf_name",
    "lora_pairs",
    "permute_rows",
    "write_gguf_lora",
]

log = logging.getLogger(__name__)
_GGUF_LAYER = {hf: gg for gg, hf in _LAYER_NAMES.items()}  # self_attn.q_proj -> attn_q
_GGUF_TOP = {hf: gg for gg, hf in _TOP_NAMES.items()}
# Hugging Face architecture -> (llama.cpp's, query/key rows permuted), as llama.cpp's
# convert_hf_to_gguf.py converts the base model: LlamaModel (Llama, Mistral) has
# undo_permute = True, Qwen2Model and Qwen3Model (a Qwen2Model) permute nothing.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}


@dataclass(frozen=True)
class GgufLora:
    """What ``write_gguf_lora`` wrote: the file, alpha, and each tensor's name and shape
    (as NumPy orders it)."""

    path: Path
    alpha: float
    tensors: dict[str, tuple[int, ...]]


def gguf_name(module: str) -> str:
    """The LLaMA GGUF name of the weight of HF module ``module``
    (``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``)."""
    top = _GGUF_TOP.get(f"{module}.weight")
    if top is not None:
        return top
    parts = module.split(".")
    if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        inner = _GGUF_LAYER.get(".".join(parts[3:]))
        if inner is not None:
            return f"blk.{parts[2]}.{inner}.weight"
    raise FinetuneError(f"LoRA on {module}: llama.cpp's LLaMA has no weight of that module")


def permute_rows(w: Array, heads: int) -> Array:
    """llama.cpp's row order of a query/key projection (rows ``[heads * dim, ...]``): each
    head's two rotary halves interleaved."""
    dim = w.shape[0] // heads // 2
    return np.ascontiguousarray(
        w.reshape(heads, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def lora_pairs(tensors: Mapping[str, Array]) -> dict[str, tuple[Array, Array]]:
    """Module -> (A ``[r, in]``, B ``[out, r]``) from PEFT's (or a step's) names."""
    a: dict[str, Array] = {}
    b: dict[str, Array] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for suffix, into in ((".lora_A.weight", a), (".lora_B.weight", b)):
            if name.endswith(suffix):
                into[name.removesuffix(suffix)] = np.asarray(value, dtype=np.float32)
    if set(a) != set(b):
        raise FinetuneError(f"LoRA factors without their pair: {sorted(set(a) ^ set(b))}")
    return {m: (a[m], b[m]) for m in sorted(a)}


def _rescale(config: Mapping[str, Any], module: str, rank: int) -> float:
    """What B must be multiplied by so llama.cpp's ``alpha / rank`` (the file's alpha, the
    pair's rank) is PEFT's scale of ``module``: its alpha (``alpha_pattern``) over its rank,
    or over the rank's square root with ``use_rslora``."""
    alpha = float(config["lora_alpha"])
    own = float((config.get("alpha_pattern") or {}).get(module, alpha))
    scale = own / (rank**0.5 if config.get("use_rslora") else rank)
    return scale * rank / alpha


def _architecture(architecture: str) -> tuple[str, bool]:
    if architecture not in ARCHITECTURES:
        raise FinetuneError(
            f"a llama.cpp LoRA adapter of a {architecture} model is not written "
            f"(its GGUF names and row order are known for {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[architecture]


def write_gguf_lora(
    adapter: Path,
    path: Path,
    *,
    heads: int,
    kv_heads: int,
    factors: Mapping[str, Array] | None = None,
    architecture: str = "LlamaForCausalLM",
    tied_head: bool = False,
) -> GgufLora:
    """Write the PEFT adapter in folder ``adapter`` as llama.cpp's GGUF LoRA file ``path``.
    ``factors`` (a ``./train --save`` file's tensors) replaces the folder's A and B values
    where it has them; ``heads``/``kv_heads``: the model's query and key-value heads;
    ``architecture``: the model's Hugging Face architecture (``ARCHITECTURES``);
    ``tied_head``: its head is the embedding."""
    from gguf import GGUFType, GGUFWriter, Keys

    arch, permuted = _architecture(architecture)
    config = _read_config(adapter / "adapter_config.json")
    if config.get("peft_type") != "LORA" or "lora_alpha" not in config:
        raise FinetuneError(f"{adapter}: not a LoRA adapter (peft_type, lora_alpha)")
    if config.get("use_dora"):
        raise FinetuneError(f"{adapter}: a DoRA adapter, which llama.cpp cannot load")
    if config.get("modules_to_save"):
        raise FinetuneError(
            f"{adapter}: the run also trains {', '.join(config['modules_to_save'])}, which a "
            "llama.cpp LoRA adapter cannot carry; export --target peft keeps them"
        )
    pairs = lora_pairs(_read_safetensors(adapter / "adapter_model.safetensors"))
    for module, (a, b) in lora_pairs(factors or {}).items():
        if module in pairs:
            if (a.shape, b.shape) != tuple(x.shape for x in pairs[module]):
                raise FinetuneError(
                    f"{module}: the state file's LoRA factors are {a.shape}, "
                    f"{b.shape}; the run's adapter has others"
                )
            pairs[module] = (a, b)
    if tied_head and "lm_head" in pairs:
        raise FinetuneError(
            f"{adapter}: LoRA on lm_head, which this model ties to the embedding: its GGUF "
            "has no output.weight for llama.cpp to adapt"
        )
    alpha = float(config["lora_alpha"])
    writer = GGUFWriter(str(path), arch)
    writer.add_type(GGUFType.ADAPTER)
    writer.add_string(Keys.Adapter.TYPE, "lora")
    writer.add_float32(Keys.Adapter.LORA_ALPHA, alpha)
    shapes: dict[str, tuple[int, ...]] = {}
    for module, (a, b) in pairs.items():
        name = gguf_name(module)
        factor = _rescale(config, module, a.shape[0])
        b = b * np.float32(factor) if factor != 1.0 else b
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            b = permute_rows(b, heads if "attn_q" in name else kv_heads)
        for tensor, value in ((f"{name}.lora_a", a), (f"{name}.lora_b", b)):
            value = np.ascontiguousarray(value, dtype=np.float32)
            writer.add_tensor(tensor, value)
            shapes[tensor] = value.shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("wrote %s: %d LoRA pairs, alpha %g", path, len(pairs), alpha)
    return GgufLora(path, alpha, shapes)


ADAPTER_TARGETS = ("gguf-lora", "peft")


@dataclass(frozen=True)
class _Model:
    heads: int
    kv_heads: int
    architecture: str
    tied_head: bool


def _model(run: Path) -> _Model:
    """The head counts, architecture and head tying of the run's model
    (``RUN/model/config.json``)."""
    import json

    path = run / "model" / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        architecture = str((config.get("architectures") or ["LlamaForCausalLM"])[0])
        tied = bool(config.get("tie_word_embeddings", False))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise FinetuneError(
            f"{path}: cannot read the model's head counts and architecture ({exc})"
        ) from exc
    if heads <= 0 or kv_heads <= 0:
        raise FinetuneError(f"{path}: head counts {heads}, {kv_heads} are not positive")
    return _Model(heads, kv_heads, architecture, tied)


def export_run_adapter(run: Path, folder: Path, target: str, state: Path | None) -> list[str]:
    """Write the LoRA adapter of run folder ``run`` into ``folder`` (new, ours):
    ``adapter.gguf`` (``gguf-lora``) or PEFT's two files (``peft``); ``state``: a
    ``./train --save`` file whose LoRA factors replace the run's. Returns the file names."""
    from pockengine.finetune.run_folder.adapter import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS
    from pockengine.safe_write import write_bytes, write_with
    from pockengine.safetensors_io import write_safetensors_to

    adapter = run / ADAPTER_DIR
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise FinetuneError(
            f"{run} has no LoRA adapter ({adapter}/{ADAPTER_CONFIG}): "
            "export --target gguf-lora/peft takes a --scheme lora run"
        )
    factors = None if state is None else _read_safetensors(state)
    if factors is not None and not lora_pairs(factors):
        raise FinetuneError(f"{state} holds no LoRA factors (*.lora_A.weight, *.lora_B.weight)")
    if target == "gguf-lora":
        model = _model(run)
        write_gguf_lora(
            adapter, folder / "adapter.gguf", heads=model.heads, kv_heads=model.kv_heads,
            factors=factors, architecture=model.architecture, tied_head=model.tied_head,
        )  # fmt: skip
        return ["adapter.gguf"]
    tensors = _read_safetensors(adapter / ADAPTER_WEIGHTS)
    for module, (a, b) in lora_pairs(factors or {}).items():
        for part, value in (("lora_A", a), ("lora_B", b)):
            key = f"{PEFT_PREFIX}{module}.{part}.weight"
            if key in tensors:
                tensors[key] = value
    write_with(folder / ADAPTER_WEIGHTS, lambda f: write_safetensors_to(f, tensors), folder)
    write_bytes(folder / ADAPTER_CONFIG, (adapter / ADAPTER_CONFIG).read_bytes(), folder)
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
