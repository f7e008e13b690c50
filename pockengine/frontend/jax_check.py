"""Before converting anything: every primitive of a jaxpr (inner jaxprs included) that the
JAX frontend cannot translate, with the user's source line; and where equations come from.

``stop_gradient`` is checked here too. The IR has no op that blocks a cotangent, so the
frontend passes the value through, which is exact where the stopped value depends on no
parameter, or where it is the max that ``log_softmax``/``logsumexp``/``softmax`` subtract
for stability (the result does not depend on that shift, so no gradient flows through it
in exact arithmetic). Any other ``stop_gradient`` of a parameter-dependent value is
reported as unsupported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pockengine.frontend.jax_ops import CONVERTERS, INLINED, inner_jaxpr, named_call
from pockengine.ir import UnsupportedOpError

__all__ = ["check_supported", "module_of", "source_line"]

# Ops that the shift of a stable (log)softmax passes through between reduce_max and
# stop_gradient: max(-inf, m), select_n(is_finite(m), 0, m), broadcasts.
_SHIFT_WRAPPERS = frozenset(
    {"max", "select_n", "broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type"}
)


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


def check_supported(jax: Any, closed: Any, params_in: int) -> None:
    """Raise one UnsupportedOpError listing every primitive that cannot be translated;
    ``params_in`` counts the leading invars that are the trained pytree's leaves."""
    missing: dict[tuple[str, str], None] = {}
    jaxpr = closed.jaxpr
    _walk(jax, jaxpr, set(jaxpr.invars[:params_in]), missing, "")
    if missing:
        raise UnsupportedOpError(
            "JAX primitives (the JAX frontend has no converter)", list(missing)
        )


def _walk(
    jax: Any, jaxpr: Any, dependent: set[Any], missing: dict[tuple[str, str], None], outer: str
) -> None:
    """Walk ``jaxpr`` recording missing primitives; ``dependent`` holds the vars that depend
    on a param (and grows as the walk goes); ``outer`` is where the call that inlines
    ``jaxpr`` came from (inside ``jnp`` functions JAX keeps no user frame)."""
    producers: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if not _is_literal(v)]
        depends = any(v in dependent for v in ins)
        for v in eqn.outvars:
            producers[v] = eqn
            if depends:
                dependent.add(v)
        if named_call(eqn) is not None:
            continue
        if name in INLINED:
            inner, _ = inner_jaxpr(eqn)
            pairs = zip(inner.invars, _tail(eqn.invars, inner), strict=True)
            args = [a for a, v in pairs if not _is_literal(v) and v in dependent]
            _walk(jax, inner, set(args), missing, _where(jax, eqn, outer))
        elif name not in CONVERTERS:
            missing[(name, _where(jax, eqn, outer))] = None
        elif name == "stop_gradient" and depends and not _is_shift(eqn, producers):
            what = "stop_gradient of a parameter-dependent value"
            missing[(what, _where(jax, eqn, outer))] = None


def _where(jax: Any, eqn: Any, outer: str) -> str:
    module = module_of(eqn)
    line = source_line(jax, eqn)
    if not line:
        return outer
    return f"{line} in {module}" if module else line


def _tail(invars: Iterable[Any], inner: Any) -> list[Any]:
    """The outer operands matching the inner jaxpr's invars (consts come first)."""
    outer = list(invars)
    return outer[len(outer) - len(inner.invars) :]


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _is_shift(eqn: Any, producers: dict[Any, Any]) -> bool:
    """Whether the stopped value is a reduce_max seen through the shift's wrappers."""
    todo, seen = [v for v in eqn.invars if not _is_literal(v)], set()
    while todo:
        v = todo.pop()
        made = producers.get(v)
        if made is None or v in seen:
            continue
        seen.add(v)
        if made.primitive.name == "reduce_max":
            return True
        if made.primitive.name in _SHIFT_WRAPPERS:
            todo.extend(x for x in made.invars if not _is_literal(x))
    return False
