"""Question/answer pairs derived from the Python documentation, for the ``smollm2-pyqa``
instruction recipe (no installable package ships instruction pairs; this corpus ships with
Debian's ``python3.11-doc``, which the ``smollm2-pydocs`` recipe reads too).

Each ``.. function::``, ``.. method::``, ``.. classmethod::`` and ``.. staticmethod::``
entry of the library reference (``library/*.rst.txt``) becomes one pair:

- the name: the directive's name as written (``str.split``), a method written unqualified
  inside a ``.. class::`` block prefixed with the class, a function prefixed with the
  ``.. module::`` / ``.. currentmodule::`` in effect (none for builtins);
- the question: ``What does `NAME` do?``;
- the answer: the entry's first paragraph, with reStructuredText markup removed
  (``:role:`~a.b``` becomes ``b``, ``:role:`text <target>``` becomes ``text``,
  ````code```` becomes ```code```, ``*x*`` becomes ``x``), cut after its first two
  sentences; entries whose paragraph is shorter than 20 characters are left out, and a
  name seen before keeps its first entry.

``split_pairs`` splits by a hash of the name, not by the seed: 10% of the names are the
held-out test split (read only for the final test metric), 10% validation, the rest
training, the same for every run whatever its seed, scheme or learning rate; each split is
in the order of the hash, so its first pairs mix modules.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["QAPair", "pydocs_pairs", "question", "split_pairs"]

_ENTRY = re.compile(r"^(\s*)\.\. (function|method|classmethod|staticmethod|class)::\s+(.*)$")
_MODULE = re.compile(r"^\.\. (?:current)?module::\s+(\S+)")
_ROLE = re.compile(r":[\w:.-]+:`([^`]*)`")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")


@dataclass(frozen=True)
class QAPair:
    """One derived pair: the documented name, its answer and where it is documented."""

    name: str
    answer: str
    where: str  # file:line of the directive

    @property
    def record(self) -> dict[str, str]:
        """The pair as a ``completion`` record (``lm_data``)."""
        return {"prompt": question(self.name), "completion": self.answer}


def question(name: str) -> str:
    return f"What does `{name}` do?"


def _role_text(match: re.Match[str]) -> str:
    text = match.group(1)
    target = re.match(r"(.*?)\s*<[^>]*>$", text)
    if target and target.group(1):
        return target.group(1)
    text = text.lstrip("!")
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def clean(text: str) -> str:
    """``text`` without reStructuredText markup (roles, literals, emphasis), one line."""
    text = _ROLE.sub(lambda m: f"`{_role_text(m).lstrip('~')}`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*", lambda m: m.group(1) or m.group(2), text)
    return " ".join(text.replace("\\", "").split())


def _first_sentences(text: str, count: int = 2) -> str:
    return " ".join(_SENTENCE.split(text)[:count])


def _paragraph(lines: list[str], start: int, indent: int) -> str:
    """The first paragraph of the body after the directive at ``start`` (lines indented
    deeper than ``indent``; signature continuations and ``:option:`` lines skipped)."""
    i = start + 1
    while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith(":"):
        i += 1  # continued signature lines
    body: list[str] = []
    for line in lines[i:]:
        stripped = line.strip()
        deeper = len(line) - len(line.lstrip()) > indent
        if not stripped:
            if body:
                break
            continue
        if not deeper or stripped.startswith(".. "):
            break
        if stripped.startswith(":") and not body:
            continue  # directive options (:noindex:, :module:)
        body.append(stripped)
    return clean(" ".join(body))


def _entries(path: Path) -> Iterable[QAPair]:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    module: str | None = None
    classes: list[tuple[int, str]] = []  # (indent, qualified name) of the open classes
    for n, line in enumerate(lines):
        found = _MODULE.match(line)
        if found:
            module = None if found.group(1) in ("builtins", "None") else found.group(1)
            classes = []
            continue
        entry = _ENTRY.match(line)
        if entry is None:
            continue
        indent, kind = len(entry.group(1)), entry.group(2)
        name = re.split(r"[\s(\[]", entry.group(3).strip(), maxsplit=1)[0]
        classes = [(i, c) for i, c in classes if i < indent]
        if kind == "class":
            qualified = name if "." in name or module is None else f"{module}.{name}"
            classes.append((indent, qualified))
            continue
        if "." not in name:
            if kind != "function" and classes:
                name = f"{classes[-1][1]}.{name}"
            elif module is not None:
                name = f"{module}.{name}"
        answer = _first_sentences(_paragraph(lines, n, indent))
        if len(answer) >= 20 and name:
            yield QAPair(name, answer, f"{path}:{n + 1}")


def pydocs_pairs(files: Iterable[Path]) -> list[QAPair]:
    """The pairs of the library reference among ``files`` (each name once, first kept)."""
    seen: set[str] = set()
    out = []
    for path in sorted(files):
        if path.parent.name != "library":
            continue
        for pair in _entries(path):
            if pair.name not in seen:
                seen.add(pair.name)
                out.append(pair)
    return out


def split_pairs(pairs: Iterable[QAPair]) -> tuple[list[QAPair], list[QAPair], list[QAPair]]:
    """Train, validation and held-out test pairs, by a hash of the name (10% each of
    validation and test), each in the order of that hash (modules mixed; the same for
    every run)."""
    splits: tuple[list[QAPair], list[QAPair], list[QAPair]] = ([], [], [])
    for pair in sorted(pairs, key=lambda p: (_hash(p.name) // 10, p.name)):
        bucket = _hash(pair.name) % 10
        splits[2 if bucket == 0 else 1 if bucket == 1 else 0].append(pair)
    return splits


def _hash(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))
