"""Fine-tuning your own causal LM on your own text, instructions or chats (``--model`` a
Hugging Face causal-LM folder or a ``.gguf`` file, ``--data`` as ``lm_data`` reads it).

It is the ``generic-lm`` recipe, which ``--model``/``--data`` choose when
``lm_kind.wants_lm`` says so (``--task lm``, or a causal-LM model). ``build_lm_task(config)``
loads the model (safetensors only, none of the folder's code; a GGUF file dequantized by
transformers), reads and tokenises the data, splits the examples with the seed, and packs
each split (``lm_pack``; with ``--packing off`` the training split one example a row in
length buckets, ``lm_buckets``): the task's arrays are ``lm_pack.PACKED_ARRAYS``, its loss
``packed_lm_loss``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.tasks import lm_buckets, lm_data, lm_pack, models
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.lm_kind import architectures, is_causal_lm_folder
from pockengine.tasks.model_files import check_model_folder
from pockengine.tasks.task import Task

__all__ = ["GGUF_ARCHITECTURES", "build_lm_task", "load_causal_lm"]

# The GGUF architectures transformers dequantizes into a causal LM the frontend imports.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file."""
    models.require("gguf", "pip install gguf", f"the GGUF model {path}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (OSError, ValueError, KeyError) as e:
        raise FinetuneError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def load_causal_lm(spec: str) -> tuple[nn.Module, Any]:
    """The causal LM and its tokenizer in a Hugging Face folder or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models.require("transformers", "pip install 'transformers>=4.45'", f"the model {spec}")
    path = Path(spec)
    safe = {"local_files_only": True, "trust_remote_code": False}
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FinetuneError(f"{path}: no such GGUF file")
        arch = gguf_architecture(path)
        if arch not in GGUF_ARCHITECTURES:
            raise FinetuneError(
                f"{path}: GGUF architecture {arch!r} is not one this reads "
                f"({', '.join(GGUF_ARCHITECTURES)})"
            )
        models.require("accelerate", "pip install accelerate", f"the GGUF model {path}")
        where: dict[str, Any] = {"gguf_file": path.name, **safe}
        folder = path.parent
    else:
        check_model_folder(path)
        if not is_causal_lm_folder(path):
            raise FinetuneError(
                f"{path}: not a causal LM (its config.json names "
                f"{architectures(path) or 'no architectures'}); "
                "leave out --task lm to train a classifier"
            )
        where, folder = {"use_safetensors": True, **safe}, path
    try:
        with models.quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **where)
            tok_where = {k: v for k, v in where.items() if k != "use_safetensors"}
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **tok_where)
    except Exception as exc:  # transformers raises many kinds; the file is the cause
        raise FinetuneError(f"cannot load the causal LM {path}: {exc}") from exc
    cfg: Any = model.config
    if hasattr(cfg, "quantization_config"):  # dequantized from GGUF: plain float32 now
        del cfg.quantization_config
    return model, tokenizer


def _split(
    examples: list[lm_data.LMExample], config: FinetuneConfig
) -> tuple[list[lm_data.LMExample], list[lm_data.LMExample]]:
    n = len(examples)
    n_val = max(1, round(config.val_fraction * n))
    if n - n_val < 1:
        raise FinetuneError(f"{n} examples: too few to hold out a validation split")
    order = np.random.default_rng([config.seed, 0x11A]).permutation(n)
    train = [examples[i] for i in order[n_val:]][: config.max_train]
    val = [examples[i] for i in order[:n_val]][: config.max_val]
    return train, val


def _bucketed(
    examples: list[lm_data.LMExample], config: FinetuneConfig, pad: int
) -> tuple[tuple[np.ndarray[Any, Any], ...], lm_buckets.BucketStats, tuple[int, ...]]:
    """The training split one example a row in length buckets (``--packing off``)."""
    assert config.seq_len is not None and config.batch_size is not None
    lengths = [len(e.ids) for e in examples]
    buckets = lm_buckets.choose_buckets(
        lengths, config.buckets, config.batch_size, lm_buckets.ENOUGH_PADDING
    )
    arrays, stats = lm_buckets.bucket_examples(examples, buckets, pad, config.seq_len)
    return arrays, stats, buckets


def build_lm_task(config: FinetuneConfig) -> Task:
    """The packed causal-LM task of ``config.model`` on ``config.data``."""
    assert config.model is not None and config.data is not None
    assert config.seq_len is not None and config.batch_size is not None
    seq = config.seq_len
    model, tokenizer = load_causal_lm(config.model)
    longest = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    if seq > longest:
        raise FinetuneError(f"seq_len {seq} is longer than the model's {longest} positions")
    data = lm_data.load_lm_data(
        config.data,
        tokenizer,
        seq,
        kind=config.data_format,
        train_on_prompt=config.train_on_prompt,
        truncate=config.truncate,
    )
    train_ex, val_ex = _split(data.examples, config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packing = config.packing == "on"
    buckets: tuple[int, ...] = ()
    train_stats: lm_pack.PackStats | lm_buckets.BucketStats
    if packing:
        train, train_stats = lm_pack.pack_examples(train_ex, seq, int(pad or 0))
    else:
        train, train_stats, buckets = _bucketed(train_ex, config, int(pad or 0))
    val, val_stats = lm_pack.pack_examples(val_ex, seq, int(pad or 0), packing=packing)
    if train_stats.rows < config.batch_size:
        raise FinetuneError(
            f"the training split packs into {train_stats.rows} rows of {seq} "
            f"tokens, fewer than one batch of {config.batch_size}; lower "
            "--batch-size or --seq-len"
        )
    notes = [f"{len(data.examples)} {data.kind} examples from {data.source}", *data.notes]
    if data.truncated:
        notes.append(
            f"{data.truncated} examples longer than {seq} tokens cut to {seq}"
            + (f", {data.dropped} of them dropped (no trained token left)" if data.dropped else "")
        )
    template = "its own" if lm_data.chat_template(tokenizer) else "the plain template"
    if data.kind != "text":
        on = "every token" if config.train_on_prompt else "assistant tokens only"
        notes.append(f"chat template: {template}; loss on {on}")
    notes += [train_stats.describe("train"), val_stats.describe("validation")]
    name = Path(config.model).stem if Path(config.model).suffix else Path(config.model).name
    torch.manual_seed(config.seed)
    return Task(
        name,
        model,
        lm_pack.packed_lm_loss,
        train,
        val,
        (),
        kind="causal-lm",
        notes=notes,
        inputs=f"{seq} tokens",
        tokenizer=tokenizer,
        home={"format": "hf-causal-lm", "packed": True},
        buckets=buckets,
    )
