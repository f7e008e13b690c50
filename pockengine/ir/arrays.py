"""``Array``: the one name the engine's signatures give a NumPy array of any shape and dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Array"]

Array = np.ndarray[Any, Any]
