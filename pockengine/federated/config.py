"""What a federated run is: its options, their checks, and its error class.

``FederatedConfig`` wraps a ``FinetuneConfig`` (the recipe, model, data, scheme,
optimizer, learning rate, batch shape and seed every client trains with) and adds the
federation: how many clients, rounds and local epochs, how the training split is cut
into client shards, FedProx's proximal weight, the per-round timeout, and faults to
inject (for tests and demonstrations), and how many client processes run at once. It
travels to client processes as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pockengine.federated.local_loss import check_local_loss
from pockengine.federated.server_step import (
    ADAPTIVE,
    SERVER_OPTIMIZERS,
    ServerStep,
    default_server_lr,
)
from pockengine.ir import PockEngineError
from pockengine.tasks.config import FinetuneConfig

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
    # the server's optimizer over the averaged update (federated.server_step): avg
    # (FedAvg), avgm (FedAvgM; also avg with server_momentum > 0), adam, yogi, adagrad
    server_optimizer: str = "avg"
    server_lr: float | None = None  # its learning rate (None: 1 for avg/avgm, 0.01 else)
    server_momentum: float = 0.0  # FedAvgM's momentum on the averaged update (0: none)
    server_betas: tuple[float, float] = (0.9, 0.99)  # adam/yogi/adagrad: beta1, beta2
    server_tau: float = 1e-3  # adam/yogi/adagrad: the adaptivity (epsilon)
    # the clients' local loss: "plain" (the task's) or "logit-adjusted" (logits + la_tau *
    # log of the client's label prior; against label skew, see federated.local_loss)
    local_loss: str = "plain"
    la_tau: float = 1.0
    # --scheme auto: the most a client may send up a round, as a fraction of what
    # full-model FedAvg sends (None: no limit beyond the memory budget)
    upload_budget: float | None = None
    # --scheme auto: the scheme chosen once for every client (``Scheme.to_dict``), filled
    # in by ``local.resolve_scheme`` before any client starts; it travels in the JSON
    scheme_choice: dict[str, Any] | None = None
    timeout: float = 600.0  # seconds a round waits for its clients
    resume: bool = False  # continue from the global state saved in out
    stop_after_round: int | None = None  # stop the server there (as if killed), for resume
    threads: int = 1  # torch threads per client process (the server keeps its own)
    # client processes at once (None: the machine's cores); clients share them beyond that
    parallel: int | None = None
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
        if self.parallel is not None and self.parallel < 1:
            raise FederatedError(f"parallel must be a positive integer, got {self.parallel}")
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
        self._validate_server()
        problem = check_local_loss(self.local_loss, self.la_tau)
        if problem:
            raise FederatedError(problem)
        if self.upload_budget is not None and not 0 < self.upload_budget <= 1:
            raise FederatedError(
                f"upload_budget is a fraction of full-model FedAvg's bytes, in (0, 1]; got "
                f"{self.upload_budget}"
            )
        if not self.timeout > 0:
            raise FederatedError(f"timeout must be > 0 seconds, got {self.timeout}")
        for spec in self.fail:
            _fault(spec, 2, "fail")
        for spec in self.delay:
            _fault(spec, 3, "delay")
        return self

    def _validate_server(self) -> None:
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise FederatedError(
                f"server_optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, "
                f"got {self.server_optimizer!r}"
            )
        if self.server_lr is not None and not self.server_lr > 0:
            raise FederatedError(f"server_lr must be > 0, got {self.server_lr}")
        if not 0 <= self.server_momentum < 1:
            raise FederatedError(f"server_momentum must be in [0, 1), got {self.server_momentum}")
        if self.server_momentum and self.server_optimizer in ADAPTIVE:
            raise FederatedError(
                f"server_momentum is FedAvgM's; server_optimizer {self.server_optimizer} "
                "takes its momentum from server_betas"
            )
        if len(self.server_betas) != 2 or not all(0 <= b < 1 for b in self.server_betas):
            raise FederatedError(
                f"server_betas must be two numbers in [0, 1), got {list(self.server_betas)}"
            )
        if not self.server_tau > 0:
            raise FederatedError(f"server_tau must be > 0, got {self.server_tau}")

    def server_step(self, statistics: frozenset[str]) -> ServerStep:
        """The server's optimizer these options describe (``statistics`` only averaged)."""
        lr = (
            self.server_lr
            if self.server_lr is not None
            else default_server_lr(self.server_optimizer)
        )
        b1, b2 = self.server_betas
        return ServerStep(
            statistics,
            lr,
            self.server_momentum,
            optimizer=self.server_optimizer,
            betas=(b1, b2),
            tau=self.server_tau,
        )

    def processes(self) -> int:
        """Client processes the simulation starts: ``parallel`` (default: the cores), at
        most one per client."""
        return min(self.clients, self.parallel or os.cpu_count() or 1)

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
        if "server_betas" in data:
            data["server_betas"] = tuple(data["server_betas"])
        return cls(**data)

    def training_dict(self) -> dict[str, Any]:
        """The options that define the federated training (checked on ``resume``); the
        server learning rate as it applies (its default resolved)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUN_FIELDS}
        if self.server_lr is None:
            out["server_lr"] = default_server_lr(self.server_optimizer)
        out["finetune"] = self.finetune.training_dict()
        return out

    def trains_as_saved(self, saved: dict[str, Any]) -> bool:
        """Whether a run saved with the options ``saved`` (``training_dict`` as JSON) trains
        as this config does. Options its version did not have yet count at their
        defaults, so a run saved before they existed resumes."""
        current = json.loads(json.dumps(self.training_dict()))
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        absent = {k: defaults[k] for k in current.keys() - saved.keys() if k in defaults}
        return {**json.loads(json.dumps(absent)), **saved} == current


_RUN_FIELDS = frozenset(
    {"resume", "timeout", "threads", "parallel", "stop_after_round", "fail", "delay"}
)


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
