"""Checking state before it is loaded: names, shapes and dtypes against the whole target.

``TrainStep.load_state`` and ``TrainStep.load_into`` are strict by default, as
``torch.nn.Module.load_state_dict`` is: every name of the target must be given, no name
may be unknown, and each array must have the target's shape and a dtype of the same kind
(float into float, int into int). Everything is checked before anything is written, so
a refused load leaves the target exactly as it was. With ``strict=False`` the arrays
that fit are loaded and the rest is returned in a ``LoadResult``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import PockEngineError
from pockengine.ir.arrays import Array

__all__ = ["LoadResult", "StateError", "load_into_module", "match_arrays"]

Spec = tuple[tuple[int, ...], np.dtype[Any]]
_SHOWN = 5  # names listed per kind in a message; the count says how many in all


class StateError(PockEngineError, ValueError):
    """Values loaded into a step or a model that do not fit it (names, shapes, dtypes), or
    a learning rate that is not a finite number > 0. Nothing was written."""


@dataclass(frozen=True)
class LoadResult:
    """What a load left out: target names not given (they keep their values), given names
    the target lacks, and given arrays of another shape or dtype kind."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        parts = []
        for label, names in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mismatched", self.mismatched),
        ):
            if names:
                more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
                parts.append(f"{len(names)} {label} ({', '.join(names[:_SHOWN])}{more})")
        return "; ".join(parts) or "complete"


def _array(value: Any) -> Array:
    if hasattr(value, "detach"):  # a torch tensor
        return np.asarray(value.detach().cpu().numpy())
    return np.asarray(value)


def _mismatch(name: str, array: Array, spec: Spec) -> str | None:
    shape, dtype = spec
    if array.shape != shape:
        return f"{name}: shape {list(array.shape)}, expected {list(shape)}"
    if not np.can_cast(array.dtype, dtype, "same_kind") or (
        array.dtype.kind in "fc" and dtype.kind in "iub"
    ):
        return f"{name}: dtype {array.dtype}, expected {dtype}"
    return None


def match_arrays(
    given: Mapping[str, Any],
    expected: Mapping[str, Spec],
    *,
    what: str,
    strict: bool,
    key: Callable[[str], str | None] = lambda name: name,
    label: Callable[[str], str] = lambda k: k,
) -> tuple[dict[str, Array], LoadResult]:
    """The given arrays that fit ``expected`` (keyed by ``key(name)``, cast to the expected
    dtype, copied) and what was left out. ``strict``: a ``StateError`` naming everything
    left out, before the caller writes anything. ``label`` names a missing key."""
    fitting: dict[str, Array] = {}
    unexpected, mismatched, refused = [], [], set()
    for name, value in given.items():
        k = key(name)
        if k is None or k not in expected:
            unexpected.append(name)
            continue
        try:
            array = _array(value)
        except (TypeError, ValueError) as exc:
            mismatched.append(f"{name}: not an array ({exc})")
            refused.add(k)
            continue
        problem = _mismatch(name, array, expected[k])
        if problem is not None:
            mismatched.append(problem)
            refused.add(k)
            continue
        fitting[k] = np.array(array, dtype=expected[k][1], copy=True)
    missing = [label(k) for k in expected if k not in fitting and k not in refused]
    result = LoadResult(tuple(missing), tuple(unexpected), tuple(mismatched))
    if strict and not result.complete:
        raise StateError(
            f"cannot load {what}: {result.describe()}; nothing was loaded "
            "(strict=False loads the names that fit and returns the rest)"
        )
    return fitting, result


def _numpy_dtype(tensor: Any) -> np.dtype[Any]:
    """The NumPy dtype of a torch tensor (float32 for floats NumPy lacks, e.g. bfloat16)."""
    try:
        return np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        return np.dtype(np.float32)


def load_into_module(state: Mapping[str, Array], model: Any, *, strict: bool) -> LoadResult:
    """Copy ``state`` (model names) into a torch module's params and buffers, checked first
    against the module's whole ``state_dict()`` (see ``match_arrays``)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise StateError(f"load_into needs a torch.nn.Module, got {type(model).__name__}")
    own = model.state_dict()
    expected = {name: (tuple(t.shape), _numpy_dtype(t)) for name, t in own.items()}
    what = f"the step's state for a {type(model).__name__}"
    fitting, result = match_arrays(state, expected, what=what, strict=strict)
    with torch.no_grad():
        for name, array in fitting.items():
            own[name].copy_(torch.from_numpy(np.array(array, order="C")))
    return result
