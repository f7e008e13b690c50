"""Causal-LM training data: raw text, ``{"text"}``, prompt/completion, Alpaca and chat JSONL,
tokenised into examples whose trained tokens are marked.

Kinds (``--data-format``, detected from the first JSONL line's keys when not named):

- ``text``: a ``.txt``/``.md`` file or a folder of them (each document tokenised, followed by
  end-of-text, joined and cut into ``seq_len`` chunks as the smollm2-pydocs recipe does), or
  JSONL ``{"text"}`` (each line one example, followed by end-of-text). Every token trains.
- ``completion``: JSONL ``{"prompt", "completion"}``, one user turn and one assistant turn.
- ``alpaca``: JSONL ``{"instruction", "input", "output"}`` (``input`` may be absent or empty):
  the user turn is the instruction, a blank line and the input.
- ``chat``: JSONL ``{"messages": [{"role", "content"}, ...]}``, roles system, user, assistant.

Conversations are rendered with the tokenizer's chat template (``tokenizer_config.json`` or
the GGUF metadata), by transformers' ``apply_chat_template``, which renders in Jinja's
immutable sandbox: no code from the model folder runs. A tokenizer without one renders
``PLAIN_TEMPLATE``. Each assistant turn is the text the template adds between the
conversation before it with the generation prompt and the conversation up to it; only its
tokens train unless ``train_on_prompt``. An example longer than ``seq_len`` is cut to its first
``seq_len`` tokens (counted; one left with no trained token is dropped) or, with ``truncate``
off, refused. Every error names the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.ir.arrays import Array
from pockengine.tasks.config import FinetuneError

__all__ = [
    "FORMATS",
    "PLAIN_TEMPLATE",
    "LMData",
    "LMExample",
    "load_lm_data",
    "read_records",
    "records_data",
]
FORMATS = ("text", "completion", "alpaca", "chat")
_KEYS = {  # the keys that name each JSONL kind, in the order detection tries them
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "completion": ("prompt", "completion"),
    "text": ("text",),
}
_ROLES = ("system", "user", "assistant")
_TEXT_SUFFIXES = (".txt", ".md")

# The template of a tokenizer without one: each turn a header line ("### User:") and its
# text, turns apart by a blank line, the assistant's text followed by end-of-text; the
# generation prompt is the assistant header.
PLAIN_TEMPLATE = (  # newlines as expressions: transformers' Jinja trims one after a tag
    "{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "### {{ m['role'] | capitalize }}:{{ '\\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\\n\\n' }}{% endif %}"
    "### Assistant:{{ '\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class LMExample:
    """One example: its token ids, which of them are trained targets, and where it came from
    (``file:line``, or ``file`` for chunks of raw text)."""

    ids: Array  # int64 [n]
    trained: Array  # bool [n]: token i is a target (predicted from the tokens before it)
    where: str


@dataclass
class LMData:
    """The examples of a dataset, its kind, and what was cut or dropped."""

    examples: list[LMExample]
    kind: str
    source: str
    truncated: int = 0
    dropped: int = 0  # truncated until no trained token was left
    notes: list[str] = field(default_factory=list)


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank JSONL line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise FinetuneError(f"{path}: cannot read it as UTF-8 text ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise FinetuneError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict):
            raise FinetuneError(f"{path}:{n}: a JSON {type(record).__name__}, not an object")
        yield n, record


def detect_kind(record: dict[str, Any], where: str) -> str:
    """The kind whose keys ``record`` has (``_KEYS`` order), or an error listing them."""
    for kind, keys in _KEYS.items():
        if all(k in record for k in keys):
            return kind
    wanted = "; ".join(" + ".join(f'"{k}"' for k in keys) for keys in _KEYS.values())
    raise FinetuneError(
        f"{where}: keys {sorted(record)} name no causal-LM data kind; expected one of: {wanted}"
    )


def load_lm_data(
    path: str | Path,
    tokenizer: Any,
    seq_len: int,
    *,
    kind: str | None = None,
    train_on_prompt: bool = False,
    truncate: bool = True,
) -> LMData:
    """The examples of ``path`` (a text file, a folder of them, or JSONL), tokenised."""
    path = Path(path)
    if kind is not None and kind not in FORMATS:
        raise FinetuneError(f"data format must be one of {', '.join(FORMATS)}; got {kind!r}")
    if path.is_dir() or path.suffix.lower() in _TEXT_SUFFIXES:
        if kind not in (None, "text"):
            raise FinetuneError(f"{path}: plain text files are --data-format text, not {kind}")
        return _raw_text(path, tokenizer, seq_len)
    if not path.is_file():
        raise FinetuneError(f"{path}: no such file or folder")
    data = LMData([], kind or "", str(path))
    for n, record in read_records(path):
        where = f"{path}:{n}"
        data.kind = data.kind or detect_kind(record, where)
        ids, trained = _encode(record, data.kind, tokenizer, where, train_on_prompt)
        _add(data, LMExample(ids, trained, where), seq_len, truncate)
    if not data.examples:
        raise FinetuneError(f"{path}: no examples" + (" left" if data.dropped else ""))
    return data


def _add(data: LMData, ex: LMExample, seq_len: int, truncate: bool) -> None:
    if len(ex.ids) > seq_len:
        if not truncate:
            raise FinetuneError(
                f"{ex.where}: the example is {len(ex.ids)} tokens, longer than --seq-len "
                f"{seq_len}; raise --seq-len, or leave out --no-truncate to cut it"
            )
        data.truncated += 1
        ex = LMExample(ex.ids[:seq_len], ex.trained[:seq_len], ex.where)
        if not ex.trained[1:].any():
            data.dropped += 1
            return
    data.examples.append(ex)


def _raw_text(path: Path, tokenizer: Any, seq_len: int) -> LMData:
    from pockengine.tasks.causal_lm import pack

    files = (
        [path]
        if path.is_file()
        else sorted(
            f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES
        )
    )
    if not files:
        raise FinetuneError(f"{path}: no .txt or .md files")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise FinetuneError(f"{f}: cannot read it as UTF-8 text ({e})") from e
    chunks = pack(tokenizer, texts, seq_len, None)
    if not len(chunks):
        raise FinetuneError(f"{path}: fewer than --seq-len {seq_len} tokens of text")
    examples = [LMExample(c, np.ones(seq_len, dtype=bool), str(path)) for c in chunks]
    note = f"{len(files)} text files, {len(chunks)} chunks of {seq_len} tokens"
    return LMData(examples, "text", str(path), notes=[note])


def _encode(
    record: dict[str, Any], kind: str, tokenizer: Any, where: str, train_on_prompt: bool
) -> tuple[Array, Array]:
    if kind == "text":
        text = _field(record, "text", where)
        tokens = [*tokenizer(text)["input_ids"], _eos(tokenizer)]
        return np.asarray(tokens, dtype=np.int64), np.ones(len(tokens), dtype=bool)
    pieces = _rendered(tokenizer, _messages(record, kind, where), where)
    ids: list[int] = []
    trained: list[bool] = []
    for i, piece in enumerate(pieces):
        tokens = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        ids += tokens
        trained += [train_on_prompt or i % 2 == 1] * len(tokens)
    return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)


def _field(record: dict[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    if key not in record:
        raise FinetuneError(f'{where}: no "{key}" key (keys: {sorted(record)})')
    value = record[key]
    if not isinstance(value, str):
        raise FinetuneError(f'{where}: "{key}" is a {type(value).__name__}, not a string')
    if not empty and not value.strip():
        raise FinetuneError(f'{where}: "{key}" is empty')
    return value


def _messages(record: dict[str, Any], kind: str, where: str) -> list[dict[str, str]]:
    if kind == "completion":
        prompt = _field(record, "prompt", where, empty=True)
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _field(record, "completion", where)}]  # fmt: skip
    if kind == "alpaca":
        user = _field(record, "instruction", where)
        extra = _field(record, "input", where, empty=True) if "input" in record else ""
        user = f"{user}\n\n{extra}" if extra.strip() else user
        return [{"role": "user", "content": user},
                {"role": "assistant", "content": _field(record, "output", where)}]  # fmt: skip
    if "messages" not in record:
        raise FinetuneError(f'{where}: no "messages" key (keys: {sorted(record)})')
    turns = record["messages"]
    if not isinstance(turns, list) or not turns:
        raise FinetuneError(f'{where}: "messages" must be a non-empty list of turns')
    out = []
    for i, turn in enumerate(turns):
        at = f'{where}: "messages"[{i}]'
        if not isinstance(turn, dict):
            raise FinetuneError(f'{at} is not an object with "role" and "content"')
        role = _field(turn, "role", at)
        if role not in _ROLES:
            raise FinetuneError(f"{at}: role {role!r} is not one of {', '.join(_ROLES)}")
        out.append({"role": role, "content": _field(turn, "content", at)})
    if not any(t["role"] == "assistant" for t in out):
        raise FinetuneError(f"{where}: the chat has no assistant turn: nothing to train on")
    return out


def chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template (None: ``PLAIN_TEMPLATE`` applies)."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template.strip() else None


def render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    """``messages`` rendered by the tokenizer's chat template, or ``PLAIN_TEMPLATE``, in
    transformers' sandboxed Jinja."""
    text: Any = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template(tokenizer) or PLAIN_TEMPLATE,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return str(text)


def _rendered(tokenizer: Any, messages: list[dict[str, str]], where: str) -> list[str]:
    """The conversation's text cut into pieces that alternate prompt, assistant turn, prompt,
    assistant turn, ... (the last prompt piece may be empty or end the text)."""
    pieces: list[str] = []
    done = ""  # the text rendered so far
    for k, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render_checked(tokenizer, messages[:k], True, where)
        upto = _render_checked(tokenizer, messages[: k + 1], False, where)
        if not (before.startswith(done) and upto.startswith(before)):
            raise FinetuneError(
                f"{where}: the chat template does not render this conversation turn by turn "
                "(an earlier turn's text changes when a later one is added), so the assistant "
                "tokens cannot be told apart; use --train-on-prompt with --data-format text"
            )
        pieces += [before[len(done) :], upto[len(before) :]]
        done = upto
    full = _render_checked(tokenizer, messages, False, where)
    if not full.startswith(done):
        raise FinetuneError(
            f"{where}: the chat template renders the whole conversation differently from its turns"
        )
    return [*pieces, full[len(done) :]]


def _render_checked(
    tokenizer: Any, messages: Sequence[dict[str, str]], gen: bool, where: str
) -> str:
    try:
        return render(tokenizer, messages, gen)
    except Exception as e:  # the template's own errors (raise_exception, undefined names)
        raise FinetuneError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from e


def _eos(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise FinetuneError("the tokenizer has no end-of-text token")
    return int(eos)


def records_data(
    records: Iterable[tuple[str, dict[str, Any]]],
    kind: str,
    tokenizer: Any,
    seq_len: int,
    source: str,
    *,
    train_on_prompt: bool = False,
    truncate: bool = True,
) -> LMData:
    """The examples of ``(where, record)`` pairs of one kind made in code (a recipe's own
    data), tokenised and cut as ``load_lm_data`` does a file's lines."""
    data = LMData([], kind, source)
    for where, record in records:
        ids, trained = _encode(record, kind, tokenizer, where, train_on_prompt)
        _add(data, LMExample(ids, trained, where), seq_len, truncate)
    return data
