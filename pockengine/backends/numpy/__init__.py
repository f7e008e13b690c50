"""The NumPy backend: the reference interpreter, and the oracle for every other backend
(``backend``)."""

from __future__ import annotations

from pockengine.backends.numpy.backend import NumpyBackend, NumpyExecutable, evaluate

__all__ = ["NumpyBackend", "NumpyExecutable", "evaluate"]
