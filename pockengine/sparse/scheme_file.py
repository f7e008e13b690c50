"""Reading a scheme file (JSON or YAML) with bounded work, and values cut for messages.

A scheme file is a few lines written by hand or by ``pockengine scheme``; a file that
is not must not make the loader do unbounded work. So a file larger than
``MAX_SCHEME_BYTES`` is refused once that much is read (never more), and YAML is parsed
by a ``SafeLoader`` that refuses anchors and aliases: a "billion laughs" file (nested
aliases, each level repeating the one below) expands to gigabytes once anything walks
it, and a scheme never needs one. Error messages quote values through ``shown``, which
cuts them to a few hundred characters without walking what it leaves out.
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any

from pockengine.ir import SchemeError

__all__ = ["MAX_SCHEME_BYTES", "read_scheme_data", "shown", "yaml_text"]

MAX_SCHEME_BYTES = 1 << 20  # 1 MiB: a scheme file is a few hundred bytes


def _repr() -> reprlib.Repr:
    cut = reprlib.Repr()  # keyword arguments need Python 3.12
    cut.maxlevel, cut.maxdict, cut.maxlist, cut.maxtuple, cut.maxset = 2, 4, 4, 4, 4
    cut.maxstring, cut.maxother, cut.maxlong = 80, 80, 40
    return cut


_SHOWN, _SHOWN_CHARS = _repr(), 160


def shown(value: Any) -> str:
    """``repr(value)`` cut short: two levels, four items each, 160 characters in all."""
    text = _SHOWN.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def read_scheme_data(path: Path) -> Any:
    """The parsed contents of a ``.json``/``.yaml``/``.yml`` scheme file; a
    ``SchemeError`` naming the file if it is too large, unreadable or does not parse."""
    try:
        with path.open("rb") as f:  # at most one byte past the cap: /dev/zero ends too
            raw = f.read(MAX_SCHEME_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemeError(f"cannot read scheme file {path}: {exc}") from exc
    if len(raw) > MAX_SCHEME_BYTES:
        raise SchemeError(
            f"scheme file {path} is larger than the {MAX_SCHEME_BYTES} bytes a scheme file may hold"
        )
    try:
        if path.suffix in (".yaml", ".yml"):
            return _yaml_load(text)
        return json.loads(text)
    except SchemeError as exc:
        raise SchemeError(f"scheme file {path}: {exc}") from None
    except Exception as exc:
        flat = " ".join(str(exc).split())  # YAML errors span lines; the message is one
        raise SchemeError(f"scheme file {path} does not parse: {flat[:300]}") from exc


def yaml_text(data: Any) -> str:
    """``data`` as YAML without anchors or aliases (a part repeated in a union is written
    out again), so that ``read_scheme_data`` reads back what ``schemes.save`` writes."""
    import yaml

    class NoAliasDumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no stubs here
        def ignore_aliases(self, data: Any) -> bool:
            return True

    text: str = yaml.dump(data, Dumper=NoAliasDumper, sort_keys=False)
    return text


def _yaml_load(text: str) -> Any:
    import yaml

    class NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no stubs here
        """PyYAML's safe loader, refusing anchors (``&a``) and aliases (``*a``)."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
                mark = self.peek_event().start_mark
                raise SchemeError(
                    f"line {mark.line + 1}, column {mark.column + 1}: uses a YAML anchor "
                    "or alias (&name, *name); a scheme file may not"
                )
            return super().compose_node(parent, index)

    loader = NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
