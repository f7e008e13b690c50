"""Frontends translate models into the IR; they never optimise."""

from __future__ import annotations

from pockengine.frontend.imported import ImportedModel, ModelInfo, ParamInfo

__all__ = ["ImportedModel", "ModelInfo", "ParamInfo"]
