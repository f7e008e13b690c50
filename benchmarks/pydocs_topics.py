"""A 6-topic text-classification CSV built from the installed Python 3.11 docs.

The generic ``--model/--data`` task of docs/quality.md: short prose paragraphs of the
standard-library reference (``/usr/share/doc/python3.11-doc/html/_sources/library``),
each labelled with the library chapter its module belongs to (the chapter's toctree):
data types, numeric, generic operating-system services, concurrency, internet protocols,
development tools. Markup roles are reduced to their text (``:func:`os.stat``` ->
``os.stat``); directives, tables, doctests and literal blocks are dropped; paragraphs of
80-600 characters (counted before a closing ``::`` is cut) are kept, and the same number
is drawn from each chapter with a fixed seed.
Nothing is downloaded; the docs are the ``python3.11-doc`` package's files.

    python benchmarks/pydocs_topics.py --out /tmp/pydocs-topics.csv --per-class 460
"""

from __future__ import annotations

import argparse
import csv
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

LIBRARY = Path("/usr/share/doc/python3.11-doc/html/_sources/library")
CHAPTERS = ("datatypes", "numeric", "allos", "concurrency", "internet", "development")
_ROLE = re.compile(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_PROSE_START = re.compile(r"[A-Z`:*(]")  # not a directive, table, doctest or list marker
_TOCTREE_ENTRY = re.compile(r"^\s+([a-z_][\w.-]*)\.rst\s*$")


def chapter_modules(chapter: str) -> list[Path]:
    """The module pages a chapter's toctree lists."""
    text = (LIBRARY / f"{chapter}.rst.txt").read_text(encoding="utf-8")
    names = [m.group(1) for line in text.splitlines() if (m := _TOCTREE_ENTRY.match(line))]
    return [LIBRARY / f"{name}.rst.txt" for name in names if (LIBRARY / f"{name}.rst.txt").exists()]


def paragraphs(page: Path) -> Iterator[str]:
    """The page's prose paragraphs (indented ones too), markup reduced to text."""
    code = False  # the block after one ending in "::" is a literal (code) block
    for block in re.split(r"\n\s*\n", page.read_text(encoding="utf-8")):
        lines = [line.strip() for line in block.splitlines()]
        after_code, code = code, block.rstrip().endswith("::")
        if after_code or not lines or not _PROSE_START.match(lines[0]):
            continue
        text = " ".join(lines)
        text = _ROLE.sub(r"\1", text).replace("``", "").replace("**", "")
        if 80 <= len(text) <= 600 and "::" not in text[:-2]:
            yield text.removesuffix("::").strip()


def build(per_class: int, seed: int, chapters: Sequence[str] = CHAPTERS) -> list[tuple[str, str]]:
    """``per_class`` (text, chapter) rows from each chapter, shuffled with ``seed``."""
    rng = random.Random(seed)
    rows: list[tuple[str, str]] = []
    for chapter in chapters:
        texts = sorted({p for page in chapter_modules(chapter) for p in paragraphs(page)})
        if len(texts) < per_class:
            raise SystemExit(f"chapter {chapter} has {len(texts)} paragraphs, < {per_class}")
        rows += [(t, chapter) for t in rng.sample(texts, per_class)]
    rng.shuffle(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the CSV to write (columns text,label)")
    p.add_argument("--per-class", type=int, default=460)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = build(args.per_class, args.seed)
    with open(args.out, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("text", "label"))
        writer.writerows(rows)
    print(f"{len(rows)} rows, {len(CHAPTERS)} classes -> {args.out}")


if __name__ == "__main__":
    main()
