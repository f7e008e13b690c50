"""``RUN/model/pockengine.json``, read and checked in one place, and the factory rule.

A run folder is data: nothing read from it names code to run. The file is checked entry by
entry (``read_model_meta``) before anything acts on it, and any wrong type or missing
entry is a ``RunFileError`` naming the file and the entry.

A ``module:factory`` run records the factory and the keyword arguments it was called with
(``factory``, ``factory_kwargs``) for the reader's information only. To load such a run the
user names the factory again (``pe.load_run(RUN, factory="mymodels:build")``, ``--factory
mymodels:build``); ``named_factory`` refuses the load when none is named or the named one
differs from the recorded one, before anything is imported. ``factory_kwargs`` are still
read from the file: they are plain values (a JSON object of numbers, strings, booleans and
nulls, checked here) passed to the code the user named. The same rule covers a factory the
run's stored options name (``config.model``), which ``pockengine evaluate`` and
``pockengine export RUN`` rebuild from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pockengine.finetune.run_folder.best import FORMAT
from pockengine.finetune.run_folder.run_files import RunFileError, read_json_object, shown
from pockengine.tasks.config import FinetuneError

__all__ = [
    "FACTORY_KINDS",
    "KINDS",
    "RunFileError",
    "check_factory_name",
    "named_factory",
    "names_factory",
    "read_model_meta",
]

KINDS = ("hf-classifier", "hf-causal-lm", "factory", "vision")
FACTORY_KINDS = ("factory",)
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_PLAIN = (str, int, float, bool, type(None))


def names_factory(value: Any) -> bool:
    """Whether a stored option reads ``module:name`` (a factory to import, were it used)."""
    return isinstance(value, str) and _FACTORY.fullmatch(value) is not None


def check_factory_name(spec: str, where: str = "--factory") -> str:
    """``spec`` when it reads ``module:name``; a ``FinetuneError`` naming ``where`` else."""
    if not isinstance(spec, str) or _FACTORY.fullmatch(spec) is None:
        raise FinetuneError(f"{where}: {shown(spec)} is not module:name (e.g. mymodels:build)")
    return spec


def named_factory(recorded: str | None, named: str | None, path: Path) -> str | None:
    """The factory to import for a run whose ``path`` records ``recorded`` (None: the run
    needs none): ``named``, the one the user gave, when it is the recorded one. Nothing is
    imported here; a refused load has imported nothing."""
    if recorded is None:
        if named is not None:
            raise FinetuneError(
                f"--factory {named}: the run in {path.parent} is not a module:factory run "
                "(it loads without one); leave --factory out"
            )
        return None
    if named is None:
        raise FinetuneError(
            f"{path} records a module:factory model ({shown(recorded)}); a run folder never "
            "names code to run, so name the factory yourself if you trust it: --factory "
            "module:name (pe.load_run(RUN, factory='module:name')), the one the run trained"
        )
    check_factory_name(named)
    if named != recorded:
        raise FinetuneError(
            f"--factory {named} differs from the factory {path} records ({shown(recorded)}); "
            "a run loads only with the factory it trained"
        )
    return named


# -- the schema ------------------------------------------------------------------------


def read_model_meta(path: Path) -> dict[str, Any]:
    """``pockengine.json`` of a run's model, every entry checked; a ``RunFileError``
    naming ``path`` and the entry otherwise."""
    meta = read_json_object(path, "model description")
    if meta.get("format") != FORMAT:
        raise RunFileError(f"{path} is not a pockengine model description (format {FORMAT})")
    kind = _entry(meta, "kind", path, _one_of(KINDS))
    task = _entry(meta, "task", path, _one_of(("classify", "causal-lm")))
    labels = _entry(meta, "labels", path, _list_of(str))
    if task == "classify" and not labels:
        raise RunFileError(f"{path}: 'labels' is empty; a classifier names its classes")
    text = kind != "vision"
    _entry(meta, "seq_len", path, _positive_int, required=text)
    _entry(meta, "config", path, _plain_object, required=False)
    _entry(meta, "weights", path, _mapping, required=False)
    for name, rule, required in _BY_KIND.get(kind, ()):
        _entry(meta, name, path, rule, required=required)
    return meta


def _entry(
    meta: Mapping[str, Any],
    name: str,
    path: Path,
    rule: Callable[[Any], str | None],
    required: bool = True,
) -> Any:
    if name not in meta or meta[name] is None:
        if required:
            raise RunFileError(f"{path} has no {name!r} entry")
        return None
    value = meta[name]
    wrong = rule(value)
    if wrong is not None:
        raise RunFileError(f"{path}: {name!r} is {shown(value)}; expected {wrong}")
    return value


def _one_of(options: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else "one of " + ", ".join(options)


def _list_of(kind: type) -> Callable[[Any], str | None]:
    def rule(value: Any) -> str | None:
        ok = isinstance(value, list) and all(isinstance(x, kind) for x in value)
        return None if ok else f"a list of {kind.__name__}"

    return rule


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return None if ok else "a positive integer"


def _mapping(value: Any) -> str | None:
    return None if isinstance(value, dict) else "a JSON object"


def _plain_object(value: Any) -> str | None:
    """A JSON object of plain values (numbers, strings, booleans, nulls)."""
    ok = isinstance(value, dict) and all(isinstance(v, _PLAIN) for v in value.values())
    return None if ok else "a JSON object of plain values (numbers, strings, booleans, nulls)"


def _factory(value: Any) -> str | None:
    ok = isinstance(value, str) and _FACTORY.fullmatch(value) is not None
    return None if ok else "module:name"


def _tokenizer(value: Any) -> str | None:
    if isinstance(value, dict) and value.get("kind") == "hf":
        return None
    if isinstance(value, dict) and value.get("kind") == "words":
        return _list_of(str)(value.get("vocab"))
    return '{"kind": "words", "vocab": [...]} or {"kind": "hf"}'


def _preprocessing(value: Any) -> str | None:
    size = value.get("resize", {}).get("size") if isinstance(value, dict) else None
    resize = value.get("resize") if isinstance(value, dict) else None
    ok = (
        isinstance(resize, dict)
        and isinstance(size, list)
        and len(size) == 2
        and all(_positive_int(s) is None for s in size)
    )
    return None if ok else 'an object with "resize": {"size": [side, side]}'


_BY_KIND: dict[str, tuple[tuple[str, Callable[[Any], str | None], bool], ...]] = {
    "factory": (
        ("factory", _factory, True),
        ("factory_kwargs", _plain_object, True),
        ("tokenizer", _tokenizer, False),
    ),
    "vision": (
        ("classes", _positive_int, True),
        ("preprocessing", _preprocessing, True),
        ("tokenizer", _tokenizer, False),
    ),
}
