"""Models to fine-tune: a Hugging Face encoder with a classification head, or a factory.

``--model`` is either a local Hugging Face model folder (loaded offline with
``AutoModel`` and ``AutoTokenizer``; a mean-pooled linear head on top) or
``module:factory``, a function returning a ``torch.nn.Module`` whose
``forward(ids, mask)`` gives logits. The factory receives those of ``num_labels``,
``vocab_size`` and ``seq_len`` that its signature names.

Nothing in a model folder executes (``model_files``): no ``auto_map`` code, no pickled
weights, no prompt. The only user code PockEngine runs is the ``module:factory`` the
user names: ``module`` is imported as Python imports it (``sys.path``: installed
packages, ``PYTHONPATH``), with the current folder put first on ``sys.path`` for that
import only (as ``python -m`` would).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pockengine.tasks.config import FinetuneError
from pockengine.tasks.model_files import (
    check_model_folder,
    check_tokenizer_folder,
    is_factory_spec,
    require,
)

__all__ = [
    "MeanPoolClassifier",
    "check_tokenizer_folder",
    "is_factory_spec",
    "load_factory",
    "load_hf_encoder",
    "load_hf_tokenizer",
    "require",
]

_POOLER_MODELS = ("bert", "roberta", "xlm-roberta", "camembert")


class MeanPoolClassifier(nn.Module):
    """An encoder, the mean of its last hidden states over unmasked tokens, a linear head.

    Sentence encoders such as all-MiniLM-L6-v2 are trained for mean pooling, so their
    first token alone carries less of the sentence than the mean does.
    """

    def __init__(self, encoder: nn.Module, hidden: int, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states: torch.Tensor = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        logits: torch.Tensor = self.head(pooled)
        return logits


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and progress bars for the duration."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")  # untyped calls
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _hf_folder(path: str) -> Path:
    require("transformers", "pip install 'transformers>=4.45'", f"the model {path}")
    folder = Path(path)
    check_model_folder(folder)
    return folder


# Loaders never run code from the folder (no auto_map classes) and never prompt for it.
_SAFE: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}


def load_hf_encoder(path: str) -> tuple[nn.Module, int, int]:
    """The encoder in a local folder (offline, safetensors only, none of the folder's own
    code), its hidden size and its longest input."""
    from transformers import AutoConfig, AutoModel

    folder = _hf_folder(path)
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(folder), **_SAFE)
            extra: dict[str, Any] = (
                {"add_pooling_layer": False} if config.model_type in _POOLER_MODELS else {}
            )
            encoder = AutoModel.from_pretrained(str(folder), use_safetensors=True, **_SAFE, **extra)
    except Exception as exc:  # transformers raises many kinds; the folder is the cause
        raise FinetuneError(f"cannot load the model in {folder}: {exc}") from exc
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    if not isinstance(hidden, int):
        raise FinetuneError(f"{folder}: its config names no hidden_size")
    longest = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
    return encoder, hidden, longest


def load_hf_tokenizer(path: str) -> Any:
    """The tokenizer in a local Hugging Face folder (offline, none of the folder's code)."""
    from transformers import AutoTokenizer

    require("transformers", "pip install 'transformers>=4.45'", f"the tokenizer {path}")
    folder = check_tokenizer_folder(path)
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(folder), **_SAFE)
    except Exception as exc:  # transformers raises many kinds; the folder is the cause
        raise FinetuneError(f"cannot load a tokenizer from {folder}: {exc}") from exc


def load_factory(spec: str, **offered: int) -> nn.Module:
    """Call ``module:factory`` with the keyword arguments its signature names."""
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # a console script does not search the working folder; `python -m` does
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: ImportError, SyntaxError, its own errors
        raise FinetuneError(f"cannot import {module_name!r} for the model {spec!r}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(cwd)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise FinetuneError(f"{module_name} has no callable {attr!r} (model {spec!r})")
    params = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    try:
        model = factory(**kwargs)
    except Exception as exc:  # the user's code failed; say where
        raise FinetuneError(f"the model factory {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise FinetuneError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model
