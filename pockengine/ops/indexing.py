"""Placeholder module, filled in by its op family (see docs/ops.md)."""

from __future__ import annotations

__all__: list[str] = []
