"""``pockengine generate``: text from a fine-tuned causal LM, streamed as it is sampled.

One token a forward pass, reusing the model's key/value cache; the next token is drawn
from the softmax of the last logits divided by ``temperature`` over the ``top_k`` most
likely tokens (``temperature`` 0: the most likely token), with a seeded
``torch.Generator``, so a seed gives the same text on the same machine. Generation stops
after ``max_new_tokens``, at the end-of-text token, or when the prompt and the new tokens
fill the model's context (``context_length``: its configured positions), whichever comes
first; ``Generated.context`` says when the context stopped it. The text is decoded from all the new
tokens each time and only what was added is emitted, held back while it ends inside a
multi-byte character.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pockengine.finetune.run_folder.home_load import LoadedRun
from pockengine.tasks.config import FinetuneError

__all__ = ["Generated", "check_generation", "context_length", "generate", "prompt_ids"]

# Where Hugging Face configs keep the most positions a model takes (GPT-2: n_positions).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


@dataclass(frozen=True)
class Generated:
    """What ``generate`` produced: the new text, its token count and the seconds it took."""

    text: str
    tokens: int
    seconds: float
    context: int | None = None  # the model's context, where it (not the count) stopped it
    prompt_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def generate(
    loaded: LoadedRun,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    on_text: Callable[[str], None] | None = None,
    stop: Collection[int] = (),
) -> Generated:
    """Continue ``prompt``; ``on_text`` receives each new piece of text as it is decoded;
    generation also ends at a token in ``stop`` (a chat template's end of turn)."""
    check_generation(loaded, max_new_tokens, temperature, top_k)
    ids = prompt_ids(loaded, prompt)
    prompt_tokens = int(ids.shape[1])
    context = context_length(loaded.model)
    room = max_new_tokens if context is None else min(max_new_tokens, context - prompt_tokens)
    stream = _TextStream(loaded.tokenizer, on_text)
    start = time.perf_counter()
    for token in _sampled(loaded, ids, room, temperature, top_k, seed, stop):
        stream.add(token)
    seconds = time.perf_counter() - start
    full = room < max_new_tokens and len(stream.tokens) == room
    return Generated(
        stream.finish(), len(stream.tokens), seconds, context if full else None, prompt_tokens
    )


def prompt_ids(loaded: LoadedRun, prompt: str) -> torch.Tensor:
    """The prompt's token ids, ``[1, n]``; a ``FinetuneError`` if it is empty or leaves
    no room in the model's context for a new token."""
    ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise FinetuneError("the prompt is empty")
    context = context_length(loaded.model)
    if context is not None and len(ids) >= context:
        raise FinetuneError(
            f"the prompt is {len(ids)} tokens; the model's context is {context} positions, "
            "which leaves no room for a new token: shorten the prompt"
        )
    return torch.tensor([ids], dtype=torch.long)


def context_length(model: torch.nn.Module) -> int | None:
    """The most positions ``model`` takes (prompt and new tokens together), from its
    Hugging Face config; None when the config states none."""
    config = getattr(model, "config", None)
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_generation(
    loaded: LoadedRun, max_new_tokens: int, temperature: float, top_k: int
) -> None:
    """A ``FinetuneError`` unless ``loaded`` is a causal LM and the settings are in range."""
    if not loaded.is_causal_lm:
        raise FinetuneError(
            f"{loaded.path} is a classifier: generate needs a causal LM run (smollm2-pydocs); "
            "use pockengine predict RUN TEXT"
        )
    if temperature < 0 or max_new_tokens < 1 or top_k < 1:
        raise FinetuneError("generate needs temperature >= 0, max_new_tokens >= 1, top_k >= 1")


def _sampled(
    loaded: LoadedRun,
    ids: torch.Tensor,
    count: int,
    temperature: float,
    top_k: int,
    seed: int,
    stop: Collection[int] = (),
) -> Iterator[int]:
    """Up to ``count`` new tokens, one forward pass each with the cache, to end-of-text."""
    rng = torch.Generator().manual_seed(seed)
    cache, past = _cache_argument(loaded.model), None
    with torch.no_grad():
        for _ in range(count):
            out = loaded.model(input_ids=ids, use_cache=True, **{cache: past})
            past = getattr(out, cache)
            token = _sample(out.logits[0, -1], temperature, top_k, rng)
            if token == loaded.tokenizer.eos_token_id or token in stop:
                return
            yield token
            ids = torch.tensor([[token]], dtype=torch.long)


class _TextStream:
    """The text of the tokens so far, handed on as it grows (not mid-character)."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None] | None) -> None:
        self.tokenizer, self.on_text = tokenizer, on_text
        self.tokens: list[int] = []
        self.emitted = ""

    def add(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def finish(self) -> str:
        text: str = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        if len(text) > len(self.emitted) and self.on_text is not None:
            self.on_text(text[len(self.emitted) :])
        self.emitted = text


def _cache_argument(model: torch.nn.Module) -> str:
    """The name of the key/value cache, in and out: ``cache`` in newer transformers,
    ``past_key_values`` before (now deprecated)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sample(logits: torch.Tensor, temperature: float, top_k: int, rng: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits.float() / temperature, min(top_k, logits.shape[-1]))
    choice = torch.multinomial(torch.softmax(values, -1), 1, generator=rng)
    return int(indices[choice])
