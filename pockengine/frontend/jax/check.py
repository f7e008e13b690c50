"""Before converting anything: every primitive of a jaxpr (inner jaxprs included) that the
JAX frontend cannot translate, with the user's source line; and where equations come from.
"""

from __future__ import annotations

import math
from typing import Any

from pockengine.frontend.jax.converters import CONVERTERS, INLINED, inner_jaxpr, named_call
from pockengine.ir import UnsupportedOpError

__all__ = ["FOLD_LIMIT", "check_supported", "foldable", "module_of", "source_line"]

FOLD_LIMIT = 4096  # static values (positions, slice starts) are folded up to this size


def source_line(jax: Any, eqn: Any) -> str:
    """The user's frame that made ``eqn`` ("model.py:12:8 (loss_fn)")."""
    try:
        from jax.extend import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except (ImportError, AttributeError):  # pragma: no cover - older or newer JAX
        return ""


def module_of(eqn: Any, prefix: str = "") -> str:
    """The module path (Flax name stack) of ``eqn``, dotted, under the ``prefix`` of the
    call that inlines it; "" outside any module."""
    stack = str(getattr(eqn.source_info, "name_stack", "") or "")
    return ".".join(p for p in (prefix, stack.replace("/", ".")) if p)


def check_supported(jax: Any, closed: Any) -> None:
    """Raise one UnsupportedOpError listing every primitive that cannot be translated."""
    missing: dict[tuple[str, str], None] = {}
    _walk(jax, closed.jaxpr, missing, "")
    if missing:
        raise UnsupportedOpError(
            "JAX primitives (the JAX frontend has no converter)", list(missing)
        )


def _walk(jax: Any, jaxpr: Any, missing: dict[tuple[str, str], None], outer: str) -> None:
    """Walk ``jaxpr`` recording missing primitives; ``outer`` is where the call that inlines
    ``jaxpr`` came from (inside ``jnp`` functions JAX keeps no user frame). A primitive
    computed from constants alone (e.g. ``floor`` of resize positions) is folded when
    translating, so it needs no converter."""
    static = {v for v in jaxpr.constvars if _size(v) <= FOLD_LIMIT}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if foldable(eqn, static):
            static.update(eqn.outvars)
            continue
        if named_call(eqn) is not None:
            continue
        if name in INLINED:
            inner, _ = inner_jaxpr(eqn)
            _walk(jax, inner, missing, _where(jax, eqn, outer))
        elif name == "scan":  # unrolled: its body is translated once per step
            _walk(jax, eqn.params["jaxpr"].jaxpr, missing, _where(jax, eqn, outer))
        elif name not in CONVERTERS:
            missing[(name, _where(jax, eqn, outer))] = None


def foldable(eqn: Any, static: set[Any]) -> bool:
    """Whether ``eqn`` reads only literals and ``static`` values and makes at most
    ``FOLD_LIMIT`` elements: the translator evaluates it with JAX instead."""
    if eqn.primitive.name in INLINED or eqn.effects:
        return False
    reads = all(type(v).__name__ == "Literal" or v in static for v in eqn.invars)
    return reads and all(_size(v) <= FOLD_LIMIT for v in eqn.outvars)


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _where(jax: Any, eqn: Any, outer: str) -> str:
    module = module_of(eqn)
    line = source_line(jax, eqn)
    if not line:
        return outer
    return f"{line} in {module}" if module else line
