"""Update schemes: which parameters train. Resolved once, against the model's parameters.

A scheme is a user-facing selector; it resolves to the set of IR param names
that train, and nothing inside the engine matches names after that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pockengine.frontend.imported import ImportedModel
from pockengine.ir import SchemeError

__all__ = ["FromModel", "Scheme", "resolve_scheme"]


class Scheme(ABC):
    """Chooses the trained params among a model's params."""

    @abstractmethod
    def select(self, model: ImportedModel) -> set[str]:
        """IR names of the params that train."""


class FromModel(Scheme):
    """Every parameter whose ``requires_grad`` is set (the default)."""

    def select(self, model: ImportedModel) -> set[str]:
        return {v.name for v in model.graph.params if v.trainable}


def resolve_scheme(scheme: Scheme | None, model: ImportedModel) -> set[str]:
    chosen = (scheme or FromModel()).select(model)
    if not chosen:
        raise SchemeError("the update scheme trains no parameter")
    return chosen
