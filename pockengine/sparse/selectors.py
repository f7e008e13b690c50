"""Selectors: the parameters each kind of update scheme trains, read off a model's
``ModelInfo`` (names, shapes, owning modules, repeated blocks, the head).

``SELECTORS`` maps a scheme kind of ``pockengine.sparse.schemes`` (other than ``lora`` and
``union``) to the function that lists the names it trains; ``block_params``, ``matching``
and ``channel_rows`` serve the partial-channel options that ``Scheme.resolve`` applies.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from pockengine.frontend.imported import ModelInfo, ParamInfo
from pockengine.ir import SchemeError

__all__ = ["SELECTORS", "block_params", "channel_rows", "matching"]

log = logging.getLogger(__name__)


def channel_rows(p: ParamInfo, ratio: float) -> int | None:
    """The leading output channels (rows) of ``p`` that ``ratio`` trains; None: all."""
    if not 0 < ratio <= 1:
        raise SchemeError(f"channel ratio {ratio} for {p.name} must be in (0, 1]")
    if p.channel_axis != 0:
        raise SchemeError(
            f"{p.name} {list(p.shape)} has its output channels on axis {p.channel_axis}; "
            "partial-channel updates slice axis 0, so a channel ratio cannot apply to it"
        )
    k = max(1, math.ceil(ratio * p.shape[0]))
    return None if k == p.shape[0] else k


def _all(info: ModelInfo) -> list[str]:
    return [p.name for p in info.params]


def _bias_norm(info: ModelInfo) -> list[str]:
    return [p.name for p in info.params if p.is_bias or p.is_norm]


def _head(info: ModelInfo) -> list[str]:
    if info.head is None:
        raise SchemeError("the model has no linear layer to serve as the head")
    prefix = f"{info.head}." if info.head else ""
    names = []
    for local in ("weight", "kernel", "bias"):
        name = prefix + local
        name = info.canonical.get(name, name)
        if any(p.name == name for p in info.params):
            names.append(name)
    return names


def block_params(info: ModelInfo, k: int, container: str | None) -> list[str]:
    """The params of the last ``k`` blocks. A model with fewer blocks (or none that repeat)
    trains the blocks it has, with a warning; a named container must exist."""
    if k < 0:
        raise SchemeError(f"the number of blocks must be >= 0, got {k}")
    if k == 0 and container is None:  # the last 0 blocks: none, whether the model has any
        return []
    if container is None and info.blocks is None:
        log.warning(
            "the model has no repeated blocks: the scheme trains no block weights "
            "(only what else it names: biases, norms, the head)"
        )
        return []
    path = container if container is not None else info.blocks
    if path is None or path not in info.containers:
        near = difflib.get_close_matches(str(path), list(info.containers), n=5, cutoff=0.3)
        raise SchemeError(
            f"no block container {path!r} in the model; containers: {near or list(info.containers)}"
        )
    children = info.containers[path]
    if k > len(children):
        log.warning(
            "%s has %d blocks, fewer than %d: training all %d",
            path,
            len(children),
            k,
            len(children),
        )
        k = len(children)
    last = children[len(children) - k :] if k else ()
    return [p.name for p in info.params if any(_inside(p.module, c) for c in last)]


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _select(
    info: ModelInfo, train: Sequence[str] = ("*",), freeze: Sequence[str] = ()
) -> list[str]:
    chosen = {p.name for p in matching(info, train, "train")}
    frozen = {p.name for p in matching(info, freeze, "freeze")}
    return [p.name for p in info.params if p.name in chosen - frozen]


def matching(info: ModelInfo, patterns: Iterable[str], what: str) -> list[ParamInfo]:
    found: list[ParamInfo] = []
    for pattern in patterns:
        hits = [p for p in info.params if _match(p, pattern, info)]
        if not hits:
            names = [p.name for p in info.params]
            near = difflib.get_close_matches(pattern, names, n=5, cutoff=0.2)
            raise SchemeError(
                f"{what} pattern {pattern!r} matches no parameter; nearest names: "
                f"{near or names[:5]}"
            )
        found.extend(hits)
    return found


def _match(p: ParamInfo, pattern: str, info: ModelInfo) -> bool:
    aliases = [a for a, c in info.canonical.items() if c == p.name]
    return any(fnmatch.fnmatchcase(n, pattern) for n in (p.name, *aliases))


def _sparse(
    info: ModelInfo,
    bias: str = "all",
    blocks: int = 2,
    head: bool = True,
    container: str | None = None,
) -> list[str]:
    # The block channel ratio ("channels" option) is applied by Scheme.resolve.
    names: set[str] = set()
    if bias == "all":
        names.update(_bias_norm(info))
    elif bias != "none":
        raise SchemeError(f"bias must be 'all' or 'none', got {bias!r}")
    names.update(block_params(info, blocks, container))
    if head:
        names.update(_head(info))
    return [p.name for p in info.params if p.name in names]


def _requires_grad(info: ModelInfo) -> list[str]:
    return [p.name for p in info.params if p.requires_grad]


SELECTORS: dict[str, Any] = {
    "requires_grad": _requires_grad,
    "full": lambda info: _all(info),
    "bias_only": lambda info: _bias_norm(info),
    "head": lambda info: _head(info),
    "last_blocks": lambda info, k, container=None, head=True: sorted(
        set(block_params(info, k, container)) | (set(_head(info)) if head else set())
    ),
    "select": _select,
    "sparse": _sparse,
}
