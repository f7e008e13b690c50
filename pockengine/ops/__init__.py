"""Op families. Importing this package registers every op into the IR's registry."""

from __future__ import annotations

from pockengine.ops import elementwise, indexing, linalg, nn, reduce, shape, update

__all__ = ["elementwise", "indexing", "linalg", "nn", "reduce", "shape", "update"]
