"""What a federated run is: its options, their checks, and its error class.

``FederatedConfig`` wraps a ``FinetuneConfig`` (the recipe, model, data, scheme,
optimizer, learning rate, batch shape and seed every client trains with) and adds the
federation: how many clients, rounds and local epochs, how the training split is cut
into client shards, FedProx's proximal weight, the per-round timeout, and faults to
inject (for tests and demonstrations). It travels to client processes as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pockengine.finetune.config import FinetuneConfig
from pockengine.ir import PockEngineError

__all__ = ["FederatedConfig", "FederatedError"]


class FederatedError(PockEngineError):
    """A federated run that cannot start or go on: a bad option, a missing package, a
    state file that does not fit, a round in which no client answered."""


@dataclass
class FederatedConfig:
    """Every option of a federated run (the training itself is ``finetune``'s)."""

    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    clients: int = 2
    rounds: int = 3
    local_epochs: int = 1
    partition: str = "iid"  # iid or dirichlet (label skew)
    alpha: float = 0.5  # Dirichlet concentration: smaller is more skewed
    proximal_mu: float = 0.0  # FedProx's proximal weight; 0 is FedAvg
    # BatchNorm statistics a client sends: "recompute" (of its shard under its final
    # weights) or "running" (the step's running statistics); see federated.batchnorm
    bn_statistics: str = "recompute"
    server_lr: float = 1.0  # the server's step along the averaged update (1: FedAvg)
    server_momentum: float = 0.0  # FedAvgM's momentum on the averaged update (0: none)
    timeout: float = 600.0  # seconds a round waits for its clients
    resume: bool = False  # continue from the global state saved in out
    stop_after_round: int | None = None  # stop the server there (as if killed), for resume
    threads: int = 1  # torch threads per client process (the server keeps its own)
    # "client:round" pairs whose training raises (faults, for tests and demonstrations)
    fail: tuple[str, ...] = ()
    # "client:round:seconds" triples whose training sleeps that long first
    delay: tuple[str, ...] = ()

    def validate(self) -> FederatedConfig:
        """``self`` if every option is in range, else a ``FederatedError`` naming it."""
        self.finetune.validate()
        for name in ("clients", "rounds", "local_epochs", "threads"):
            if getattr(self, name) < 1:
                raise FederatedError(
                    f"{name} must be a positive integer, got {getattr(self, name)}"
                )
        if self.partition not in ("iid", "dirichlet"):
            raise FederatedError(f"partition must be iid or dirichlet, got {self.partition!r}")
        if self.stop_after_round is not None and self.stop_after_round < 1:
            raise FederatedError(f"stop_after_round must be >= 1, got {self.stop_after_round}")
        if not self.alpha > 0:
            raise FederatedError(f"alpha (Dirichlet concentration) must be > 0, got {self.alpha}")
        if not self.proximal_mu >= 0:
            raise FederatedError(f"proximal_mu must be >= 0, got {self.proximal_mu}")
        if self.bn_statistics not in ("recompute", "running"):
            raise FederatedError(
                f"bn_statistics must be recompute or running, got {self.bn_statistics!r}"
            )
        if not self.server_lr > 0:
            raise FederatedError(f"server_lr must be > 0, got {self.server_lr}")
        if not 0 <= self.server_momentum < 1:
            raise FederatedError(f"server_momentum must be in [0, 1), got {self.server_momentum}")
        if not self.timeout > 0:
            raise FederatedError(f"timeout must be > 0 seconds, got {self.timeout}")
        for spec in self.fail:
            _fault(spec, 2, "fail")
        for spec in self.delay:
            _fault(spec, 3, "delay")
        return self

    def fails(self, client: int, server_round: int) -> bool:
        """Whether the fault options make ``client`` fail in ``server_round``."""
        return any(_fault(s, 2, "fail")[:2] == (client, server_round) for s in self.fail)

    def delay_s(self, client: int, server_round: int) -> float:
        """Seconds the fault options make ``client`` sleep before training."""
        for spec in self.delay:
            c, r, seconds = _fault(spec, 3, "delay")
            if (c, r) == (client, server_round):
                return seconds
        return 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FederatedConfig:
        data: dict[str, Any] = json.loads(text)
        data["finetune"] = FinetuneConfig(**data["finetune"])
        data["fail"], data["delay"] = tuple(data["fail"]), tuple(data["delay"])
        return cls(**data)

    def training_dict(self) -> dict[str, Any]:
        """The options that define the federated training (checked on ``resume``)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUN_FIELDS}
        out["finetune"] = self.finetune.training_dict()
        return out


_RUN_FIELDS = frozenset({"resume", "timeout", "threads", "stop_after_round", "fail", "delay"})


def _fault(spec: str, parts: int, what: str) -> tuple[int, int, float]:
    """``client:round`` (or ``client:round:seconds``) as numbers."""
    fields = spec.split(":")
    try:
        if len(fields) != parts:
            raise ValueError(spec)
        client, server_round = int(fields[0]), int(fields[1])
        seconds = float(fields[2]) if parts == 3 else 0.0
    except ValueError:
        form = "CLIENT:ROUND" + (":SECONDS" if parts == 3 else "")
        raise FederatedError(f"--{what} {spec!r}: expected {form}") from None
    return client, server_round, seconds
