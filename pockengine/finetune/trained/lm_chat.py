"""``pockengine generate RUN --chat``: a multi-turn chat with a fine-tuned causal LM, one user
turn a line of standard input. Each turn the conversation so far is rendered with the run's
chat template (the tokenizer's own, or ``lm_data.PLAIN_TEMPLATE``, as in training) with the
generation prompt, and the reply is sampled (``generation.generate``) until end-of-text, the
template's end-of-turn token or ``max_new_tokens``; the reply joins the conversation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pockengine.finetune.run_folder.home_load import LoadedRun
from pockengine.finetune.trained.generation import Generated, generate
from pockengine.tasks import lm_data

__all__ = ["chat", "end_of_turn"]


def end_of_turn(tokenizer: Any) -> set[int]:
    """The special token the template puts right after an assistant turn (ChatML's
    ``<|im_end|>``, LLaMA 3's ``<|eot_id|>``), if it puts one there; end-of-text too."""
    marker = "\x00reply\x00"
    text = lm_data.render(
        tokenizer,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
        False,
    )
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    after = text.split(marker, 1)[-1]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    if ids and ids[0] in special:
        stops.add(int(ids[0]))
    return stops


def chat(
    loaded: LoadedRun,
    lines: Iterable[str],
    on_text: Callable[[str], None],
    *,
    system: str | None = None,
    **sampling: Any,
) -> list[Generated]:
    """Reply to each non-blank line of ``lines`` in turn; ``sampling``: ``generate``'s
    settings (max_new_tokens, temperature, top_k, seed)."""
    messages = [{"role": "system", "content": system}] if system else []
    stops = end_of_turn(loaded.tokenizer)
    replies = []
    for line in lines:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        prompt = lm_data.render(loaded.tokenizer, messages, True)
        done = generate(loaded, prompt, on_text=on_text, stop=stops, **sampling)
        on_text("\n")
        messages.append({"role": "assistant", "content": done.text.strip()})
        replies.append(done)
    return replies
