"""The server's step from the clients' average to the next global state (FedAvgM).

FedAvg takes the clients' weighted average as the next global state. Seen as an
optimizer on the server (Reddi et al., 2021, "Adaptive Federated Optimization"), that is
a step of size 1 along the average update ``delta = average - global``. ``ServerStep``
generalises it as FedAvgM (Hsu et al., 2019): ``v = momentum * v + delta`` and
``global += lr * v`` on the trained params. Statistics (BatchNorm's running mean and
variance) are not trained: they always take the clients' average. With ``lr`` 1 and
``momentum`` 0 the average is returned as it is, bit for bit. The velocity ``v`` is
part of the server's state and is saved with the global state for a resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ServerStep"]

Array = np.ndarray[Any, Any]


class ServerStep:
    """FedAvg (``lr`` 1, ``momentum`` 0) or FedAvgM over named arrays."""

    def __init__(self, statistics: frozenset[str], lr: float = 1.0, momentum: float = 0.0) -> None:
        self.statistics, self.lr, self.momentum = statistics, lr, momentum
        self.velocity: dict[str, Array] = {}

    @property
    def is_plain(self) -> bool:
        return self.lr == 1.0 and self.momentum == 0.0

    def apply(self, current: dict[str, Array], average: dict[str, Array]) -> dict[str, Array]:
        """The next global state from ``current`` and the clients' ``average``."""
        if self.is_plain:
            return average
        out = {}
        for name, mean in average.items():
            if name in self.statistics:
                out[name] = mean
                continue
            delta = mean.astype(np.float64) - current[name]
            if name in self.velocity:
                delta = self.momentum * self.velocity[name] + delta
            self.velocity[name] = delta
            out[name] = (current[name] + self.lr * delta).astype(current[name].dtype)
        return out
