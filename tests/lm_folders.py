"""Tiny causal-LM folders built in code for the own-LLM tests: a byte-level BPE tokenizer
trained on a few sentences, and a random 2-layer model of a chosen architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["CHATML", "SENTENCES", "make_lm_folder", "make_tokenizer"]

SENTENCES = [
    "the cat sat on the mat and looked at the dog",
    "a question about python lists: how do I sort them?",
    "use sorted(xs) or xs.sort() to sort a list in python",
    "hello there, how are you doing today my friend",
    "### User: ### Assistant: ### System:",
]
# A ChatML template as Qwen and SmolLM ship it (no system default).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chat_template: str | None = CHATML) -> Any:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(SENTENCES * 4, vocab_size=400, min_frequency=1,
                            special_tokens=special)  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")  # fmt: skip
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


_SIZES: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": 2},
    "qwen2": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2},
    "gemma": {"num_key_value_heads": 2, "head_dim": 8},
}


def make_lm_folder(
    folder: Path, arch: str = "llama", chat_template: str | None = CHATML, seed: int = 0
) -> Path:
    """A random tiny ``arch`` causal LM and its tokenizer, saved as a Hugging Face folder."""
    import transformers

    tok = make_tokenizer(chat_template)
    config_cls = transformers.AutoConfig.for_model(arch).__class__
    config = config_cls(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **_SIZES[arch],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _permuted(w: Any, heads: int) -> Any:
    """llama.cpp's row order for a rotary projection (``convert_hf_to_gguf``'s permute)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(folder: Path, path: Path, *, q8: bool = False, arch: str = "llama") -> Path:
    """The LLaMA-like model and byte-level BPE tokenizer of ``folder`` as a float32 GGUF file,
    as llama.cpp's converter writes one for ``arch`` (q/k rows permuted for ``llama`` only,
    biases as ``.bias``, the tokenizer and chat template in the metadata); ``q8``: the block
    matrices as Q8_0."""
    import json

    import gguf
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            if arch == "llama" and part == "self_attn.q_proj":
                w = _permuted(w, cfg.num_attention_heads)
            elif arch == "llama" and part == "self_attn.k_proj":
                w = _permuted(w, cfg.num_key_value_heads)
            if q8 and w.ndim == 2:
                kind = gguf.GGMLQuantizationType.Q8_0
                writer.add_tensor(f"blk.{layer}.{names[part]}.weight",
                                  gguf.quants.quantize(w, kind), raw_dtype=kind)  # fmt: skip
                continue
            writer.add_tensor(f"blk.{layer}.{names[part]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
