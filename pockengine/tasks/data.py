"""Datasets for fine-tuning: loading, de-duplication, seeded splits, tokenisation, order.

A labelled text dataset comes from a CSV file, a JSONL file or a folder whose
subfolders are the classes (one text per file). Every malformed input raises a
``FinetuneError`` that names the file, the line and what to fix. Splits are
stratified and seeded; the order of each training epoch is a seeded permutation, so
a resumed run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.ir.arrays import Array
from pockengine.tasks.config import FinetuneError

__all__ = [
    "TextDataset",
    "WordTokenizer",
    "dedupe",
    "encode_hf",
    "epoch_order",
    "fingerprint",
    "load_dataset",
    "split",
    "split_indices",
]


@dataclass(frozen=True)
class TextDataset:
    """Texts with their labels (names, as in the file)."""

    texts: tuple[str, ...]
    labels: tuple[str, ...]
    source: str
    replaced: int = 0  # undecodable bytes replaced by U+FFFD (recipes that allow it)
    empty: int = 0  # rows (files) left out of the file because their text is empty

    def __len__(self) -> int:
        return len(self.texts)

    def label_names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.labels)))

    def label_ids(self, names: Sequence[str]) -> Array:
        index = {name: i for i, name in enumerate(names)}
        return np.array([index[label] for label in self.labels], dtype=np.int64)

    def take(self, indices: Iterable[int]) -> TextDataset:
        idx = list(indices)
        texts = tuple(self.texts[i] for i in idx)
        labels = tuple(self.labels[i] for i in idx)
        return TextDataset(texts, labels, self.source, self.replaced, self.empty)

    def head(self, n: int | None) -> TextDataset:
        return self if n is None or n >= len(self) else self.take(range(n))


# -- loading -------------------------------------------------------------------------


def load_dataset(
    path: str | Path,
    text_column: str = "text",
    label_column: str = "label",
    encoding: str = "utf-8",
) -> TextDataset:
    """A labelled dataset from a ``.csv``/``.tsv``, ``.jsonl`` file or a class folder, its
    text decoded with ``encoding`` (bytes that do not decode: an error naming the line)."""
    p = Path(path)
    if not p.exists():
        raise FinetuneError(f"dataset {p} does not exist")
    if p.is_dir():
        data = load_folder(p, encoding=encoding)
    elif p.suffix.lower() in (".csv", ".tsv"):
        data = load_csv(p, text_column, label_column, encoding=encoding)
    elif p.suffix.lower() in (".jsonl", ".ndjson"):
        data = load_jsonl(p, text_column, label_column, encoding=encoding)
    else:
        raise FinetuneError(
            f"dataset {p}: unknown format {p.suffix!r}; use .csv, .tsv, .jsonl or a folder "
            "with one subfolder per class"
        )
    classes = data.label_names()
    if len(classes) < 2:
        raise FinetuneError(
            f"dataset {p} has {len(classes)} class(es) {list(classes)}; "
            "classification needs at least 2"
        )
    return data


def _read_text(p: Path, encoding: str = "utf-8", replace: bool = False) -> tuple[str, int]:
    """The text of ``p`` and the number of bytes replaced (``replace``: undecodable bytes
    become U+FFFD, counted; otherwise they are an error naming the file and line)."""
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise FinetuneError(f"cannot read {p}: {exc}") from exc
    try:
        return raw.decode(encoding), 0
    except LookupError as exc:
        raise FinetuneError(f"unknown text encoding {encoding!r} (--encoding)") from exc
    except UnicodeDecodeError as exc:
        if replace:
            text = raw.decode(encoding, errors="replace")
            return text, text.count("\ufffd") - raw.decode(encoding, "ignore").count("\ufffd")
        line = raw.count(b"\n", 0, exc.start) + 1
        raise FinetuneError(
            f"{p}:{line}: not {encoding} text (byte {raw[exc.start]:#04x} at offset "
            f"{exc.start}); give the file's encoding with --encoding, e.g. --encoding latin-1"
        ) from exc


def load_csv(
    p: Path, text_column: str, label_column: str, encoding: str = "utf-8", replace: bool = False
) -> TextDataset:
    text, replaced = _read_text(p, encoding, replace)
    if not text.strip():
        raise FinetuneError(f"dataset {p} is empty")
    rows = _csv_rows(p, text)
    header = rows[0][1]
    body = [(line, row) for line, row in rows[1:] if row]
    if not body:
        raise FinetuneError(f"dataset {p} has a header but no rows")
    ti, li = (
        _column(p, header, c, what) for c, what in ((text_column, "text"), (label_column, "label"))
    )
    texts, labels = [], []
    for line, row in body:
        if len(row) != len(header):
            raise FinetuneError(
                f"{p}:{line}: {len(row)} fields, the header has {len(header)} "
                "(quote fields that hold the delimiter)"
            )
        texts.append(row[ti])
        labels.append(_label(p, line, row[li], label_column))
    return _with_text(p, texts, labels, f"every text in column {text_column!r}", replaced)


def _csv_rows(p: Path, text: str) -> list[tuple[int, list[str]]]:
    """Rows with the line each starts on (quoted fields may span lines)."""
    old_limit = csv.field_size_limit(2**31 - 1)  # long articles fit in one field
    rows = []
    try:
        reader = csv.reader(
            io.StringIO(text, newline=""), delimiter="\t" if p.suffix == ".tsv" else ","
        )
        line = 1
        for row in reader:
            rows.append((line, row))
            line = reader.line_num + 1
    except csv.Error as exc:
        raise FinetuneError(f"{p}:{line}: not valid CSV ({exc})") from exc
    finally:
        csv.field_size_limit(old_limit)
    return rows


def _column(p: Path, header: Sequence[str], name: str, what: str) -> int:
    if name not in header:
        raise FinetuneError(
            f"dataset {p} has no {what} column {name!r}; its columns are "
            f"{list(header)} (choose with --{what}-column)"
        )
    return list(header).index(name)


def _label(p: Path, line: int, value: Any, column: str) -> str:
    label = "" if value is None else str(value).strip()
    if not label:
        raise FinetuneError(f"{p}:{line}: empty label (column {column!r})")
    return label


def _with_text(
    p: Path, texts: list[str], labels: list[str], every: str, replaced: int = 0
) -> TextDataset:
    """The rows whose text is not empty (or only white space), the others counted in
    ``empty``; a ``FinetuneError`` naming the file when no row has a text: a wrong
    ``--text-column`` or an export gone wrong must never train on nothing."""
    keep = [i for i, text in enumerate(texts) if text.strip()]
    if not keep:
        raise FinetuneError(
            f"{every} of {p} is empty ({len(texts)} in all): nothing to train on "
            "(choose the text with --text-column)"
        )
    return TextDataset(
        tuple(texts[i] for i in keep),
        tuple(labels[i] for i in keep),
        str(p),
        replaced,
        len(texts) - len(keep),
    )


def load_jsonl(
    p: Path, text_column: str, label_column: str, encoding: str = "utf-8"
) -> TextDataset:
    text, _ = _read_text(p, encoding)
    lines = [(i + 1, s) for i, s in enumerate(text.splitlines()) if s.strip()]
    if not lines:
        raise FinetuneError(f"dataset {p} is empty")
    texts, labels = [], []
    for line, s in lines:
        try:
            row = json.loads(s)
        except json.JSONDecodeError as exc:
            raise FinetuneError(f"{p}:{line}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise FinetuneError(f"{p}:{line}: each line must be a JSON object")
        for name, what in ((text_column, "text"), (label_column, "label")):
            if name not in row:
                raise FinetuneError(
                    f"{p}:{line}: no {what} field {name!r}; fields: "
                    f"{sorted(row)} (choose with --{what}-column)"
                )
        value = row[text_column]
        texts.append("" if value is None else str(value))
        labels.append(_label(p, line, row[label_column], label_column))
    return _with_text(p, texts, labels, f"every text in field {text_column!r}")


def load_folder(p: Path, encoding: str = "utf-8", replace: bool = False) -> TextDataset:
    """One subfolder per class, one text per file (hidden files skipped)."""
    classes = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise FinetuneError(f"dataset folder {p} has no class subfolders")
    texts, labels, replaced = [], [], 0
    for d in classes:
        files = sorted(f for f in d.iterdir() if f.is_file() and not f.name.startswith("."))
        for f in files:
            text, n = _read_text(f, encoding, replace)
            texts.append(text)
            replaced += n
        labels += [d.name] * len(files)
    if not texts:
        raise FinetuneError(f"dataset folder {p}: its class subfolders hold no files")
    return _with_text(p, texts, labels, "every file", replaced)


# -- cleaning, splitting, order -------------------------------------------------------


def dedupe(data: TextDataset) -> tuple[TextDataset, int]:
    """The dataset without exact duplicate texts (first one kept), and how many went."""
    seen: set[str] = set()
    keep = []
    for i, text in enumerate(data.texts):
        if text not in seen:
            seen.add(text)
            keep.append(i)
    return data.take(keep), len(data) - len(keep)


def split(data: TextDataset, val_fraction: float, seed: int) -> tuple[TextDataset, TextDataset]:
    """A stratified, seeded train/validation split; each part in a seeded shuffled order."""
    train, val = split_indices(data.labels, val_fraction, seed)
    return data.take(train.tolist()), data.take(val.tolist())


def split_indices(labels: Sequence[Any], val_fraction: float, seed: int) -> tuple[Array, Array]:
    """Indices of a stratified, seeded train/validation split, each in a shuffled order."""
    rng = np.random.default_rng([seed, 0x5117])
    keys = [str(label) for label in labels]
    train: list[int] = []
    val: list[int] = []
    for name in sorted(set(keys)):
        members = np.array([i for i, key in enumerate(keys) if key == name])
        members = members[rng.permutation(len(members))]
        n_val = round(val_fraction * len(members)) if len(members) > 1 else 0
        val += members[:n_val].tolist()
        train += members[n_val:].tolist()
    train_idx = np.array(train, dtype=np.int64)[rng.permutation(len(train))]
    return train_idx, np.array(val, dtype=np.int64)[rng.permutation(len(val))]


def epoch_order(n: int, seed: int, epoch: int) -> Array:
    """The order of the ``n`` training examples in ``epoch``: a pure function of both."""
    return np.random.default_rng([seed, 0xE90C, epoch]).permutation(n).astype(np.int64)


def fingerprint(*arrays: Array) -> str:
    """A short hash of arrays' shapes, dtypes and bytes (a resumed run's data must match)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype}{a.shape}".encode())
        for block in _byte_blocks(a):
            h.update(block)
    return h.hexdigest()[:16]


_HASH_BLOCK = 4 << 20  # bytes copied at a time from an array that is not contiguous


def _byte_blocks(a: Array) -> Iterator[memoryview]:
    """``a``'s bytes in C order: a view of a contiguous array, else copies of a few MiB of
    its rows at a time. Never a copy of the whole array (``tobytes`` was one: 98 MiB for
    lite0-fashion's training images, at the start of every run and of auto's analysis)."""
    if a.flags.c_contiguous:
        yield a.reshape(-1).view(np.uint8).data
        return
    rows = max(1, _HASH_BLOCK // max(1, a[0].nbytes))
    for start in range(0, len(a), rows):
        yield np.ascontiguousarray(a[start : start + rows]).reshape(-1).view(np.uint8).data


# -- tokenisation ----------------------------------------------------------------------


# Texts a tokenizer call encodes at once. A fast tokenizer holds every token of every
# whole text (offsets, strings) before it truncates, about 100 bytes a token: all of BBC
# News at once left 150 MiB of freed heap in the process, a chunk of 64 texts leaves ~5.
ENCODE_CHUNK = 64


def encode_hf(
    tokenizer: Any, texts: Sequence[str], seq_len: int, chunk: int = ENCODE_CHUNK
) -> tuple[Array, Array]:
    """Token ids and attention mask, padded and truncated to ``seq_len``, int64; encoded
    ``chunk`` texts at a time into arrays allocated once (the same ids as one call)."""
    ids = np.zeros((len(texts), seq_len), dtype=np.int64)
    mask = np.zeros_like(ids)
    for start in range(0, len(texts), chunk):
        part = list(texts[start : start + chunk])
        enc = tokenizer(
            part, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np"
        )
        ids[start : start + len(part)] = enc["input_ids"]
        mask[start : start + len(part)] = enc["attention_mask"]
    return ids, mask


_WORD = re.compile(r"\w+|[^\w\s]")


class WordTokenizer:
    """Lower-cased words and punctuation; the most frequent ``max_vocab`` (ties: in
    alphabetical order) of the texts it was fitted on. Id 0 pads, id 1 is unknown."""

    PAD, UNK = 0, 1

    def __init__(self, vocab: Sequence[str]) -> None:
        self.vocab = tuple(vocab)
        self._index = {w: i + 2 for i, w in enumerate(self.vocab)}

    @classmethod
    def fit(cls, texts: Iterable[str], max_vocab: int = 20000) -> WordTokenizer:
        counts = Counter(w for t in texts for w in _WORD.findall(t.lower()))
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        return cls(ranked[:max_vocab])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + 2

    def encode(self, texts: Sequence[str], seq_len: int) -> tuple[Array, Array]:
        ids = np.zeros((len(texts), seq_len), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())[:seq_len]
            ids[row, : len(words)] = [self._index.get(w, self.UNK) for w in words]
            mask[row, : len(words)] = 1
        return ids, mask
