"""The server's step from the clients' average to the next global state.

FedAvg takes the clients' weighted average as the next global state. Seen as an
optimizer on the server (Reddi et al., 2021, "Adaptive Federated Optimization"), that is
a step of size 1 along the averaged update ``delta = average - global``. ``ServerStep``
generalises it, per trained array and element:

- ``avg`` / ``avgm`` (FedAvgM, Hsu et al., 2019): ``v = momentum * v + delta``,
  ``global += lr * v``. With ``lr`` 1 and ``momentum`` 0 the average is returned as it
  is, bit for bit.
- ``adam``, ``yogi``, ``adagrad`` (Reddi et al., Algorithm 2, without bias correction):
  ``m = beta1 * m + (1 - beta1) * delta`` and ``global += lr * m / (sqrt(s) + tau)``,
  where the second moment ``s`` starts at ``tau**2`` and is updated as
  ``s + delta**2`` (FedAdagrad), ``beta2 * s + (1 - beta2) * delta**2`` (FedAdam) or
  ``s - (1 - beta2) * delta**2 * sign(s - delta**2)`` (FedYogi).

The arrays are the messages' arrays: a partial-channel param is its trained leading rows
only, so the server's moments have that shape and merging the result into a step moves
only those rows. Statistics (BatchNorm's running mean and variance) are not trained:
they always take the clients' average. The moments are the server's state, saved with
the global state (``state``) and restored on a resume (``load_state``). The moments are
kept in float64; the global arrays keep their dtype.
"""

from __future__ import annotations

import numpy as np

from pockengine.ir.arrays import Array

__all__ = ["ADAPTIVE", "SERVER_OPTIMIZERS", "ServerStep", "default_server_lr"]

SERVER_OPTIMIZERS = ("avg", "avgm", "adam", "yogi", "adagrad")
ADAPTIVE = frozenset({"adam", "yogi", "adagrad"})
# prefixes of the server's state in the saved global state (``velocity`` is FedAvgM's
# and the adaptive optimizers' first moment)
_PREFIXES = {"velocity": "server-velocity:", "second_moment": "server-second-moment:"}


def default_server_lr(optimizer: str) -> float:
    """The server learning rate when none is given: 1 (FedAvg's step) for ``avg`` and
    ``avgm``, 0.01 for the adaptive optimizers (their step is about ``lr`` per element)."""
    return 0.01 if optimizer in ADAPTIVE else 1.0


class ServerStep:
    """The server's optimizer over named arrays; see the module docstring."""

    def __init__(
        self,
        statistics: frozenset[str],
        lr: float = 1.0,
        momentum: float = 0.0,
        *,
        optimizer: str = "avg",
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-3,
    ) -> None:
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer must be one of {SERVER_OPTIMIZERS}: {optimizer!r}")
        self.statistics, self.lr, self.momentum = statistics, lr, momentum
        self.optimizer, self.betas, self.tau = optimizer, betas, tau
        self.velocity: dict[str, Array] = {}
        self.second_moment: dict[str, Array] = {}

    @property
    def is_plain(self) -> bool:
        return self.optimizer in ("avg", "avgm") and self.lr == 1.0 and self.momentum == 0.0

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
            step = (
                self._adaptive(name, delta)
                if self.optimizer in ADAPTIVE
                else self._avgm(name, delta)
            )
            out[name] = (current[name] + self.lr * step).astype(current[name].dtype)
        return out

    def _avgm(self, name: str, delta: Array) -> Array:
        if name in self.velocity:
            delta = self.momentum * self.velocity[name] + delta
        self.velocity[name] = delta
        return delta

    def _adaptive(self, name: str, delta: Array) -> Array:
        beta1, beta2 = self.betas
        m = self.velocity.get(name, np.zeros_like(delta))
        s = self.second_moment.get(name, np.full_like(delta, self.tau**2))
        m = beta1 * m + (1.0 - beta1) * delta
        square = delta * delta
        if self.optimizer == "adagrad":
            s = s + square
        elif self.optimizer == "adam":
            s = beta2 * s + (1.0 - beta2) * square
        else:  # yogi
            s = s - (1.0 - beta2) * square * np.sign(s - square)
        self.velocity[name], self.second_moment[name] = m, s
        step: Array = m / (np.sqrt(s) + self.tau)
        return step

    def state(self) -> dict[str, Array]:
        """The server's moments, named for the saved global state."""
        return {
            _PREFIXES[kind] + name: array
            for kind in _PREFIXES
            for name, array in getattr(self, kind).items()
        }

    def load_state(self, arrays: dict[str, Array]) -> dict[str, Array]:
        """Restore the moments from a saved global state; the rest of ``arrays``."""
        rest = dict(arrays)
        for kind, prefix in _PREFIXES.items():
            moments = {k[len(prefix) :]: rest.pop(k) for k in list(rest) if k.startswith(prefix)}
            setattr(self, kind, moments)
        return rest
