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
