"""The server's strategy: weighted FedAvg (or FedProx) over named, partial arrays.

``SparseFedAvg`` is Flower's ``FedAvg`` (Message API) with what sparse updates need:
every reply's ``ArrayRecord`` must hold exactly the trained tensors (names and shapes
of the ``TrainedSet``; partial-channel params as their trained rows), or the reply is
dropped from the round like a failed or late one; the weighted average runs name by
name over those arrays only, so frozen weights are never in any message. It counts
what each round sends (``bytes_down``) and receives (``bytes_up``), which clients
answered, and their training time, in ``rounds[r]`` for the server's log.
``proximal_mu`` > 0 asks the clients for FedProx's proximal pull (see ``local``).
After averaging, ``batchnorm`` pools the BatchNorm statistics as those of the pooled
data (``batchnorm.BatchNormStats.pool``) and ``server`` takes the server's step from the
average (``server_step.ServerStep``: the average itself by default, FedAvgM if asked).
``round_offset`` numbers the rounds of a resumed run after those already done. A round
in which no client trained (every reply failed, was malformed or late) is a
``FederatedError``: the run stops with the previous round's state saved. The
first round waits for all the clients to connect; later rounds sample the clients still
connected, so a node that leaves a deployment does not stall the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from pockengine.federated.batchnorm import BatchNormStats
from pockengine.federated.client import ARRAYS, METRICS, to_arrays, to_record
from pockengine.federated.config import FederatedError
from pockengine.federated.payload import TrainedSet, nbytes
from pockengine.federated.server_step import ServerStep
from pockengine.ir.arrays import Array

__all__ = ["SparseFedAvg"]

log = logging.getLogger(__name__)


class SparseFedAvg(FedAvg):
    """FedAvg over the trained tensors only; see the module docstring."""

    def __init__(
        self,
        trained: TrainedSet,
        clients: int,
        proximal_mu: float = 0.0,
        round_offset: int = 0,
        *,
        server: ServerStep | None = None,
        batchnorm: BatchNormStats | None = None,
    ) -> None:
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,  # evaluation is central, on the server's held-out split
            min_train_nodes=1,  # a round goes on with whichever clients answer
            min_evaluate_nodes=0,
            min_available_nodes=clients,
            arrayrecord_key=ARRAYS,
            train_metrics_aggr_fn=_train_metrics,
        )
        self.trained, self.proximal_mu, self.round_offset = trained, proximal_mu, round_offset
        self.server = server or ServerStep(trained.buffers)
        self.batchnorm = batchnorm or BatchNormStats({})
        self.rounds: dict[int, dict[str, Any]] = {}
        self._global: dict[str, Array] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global trained tensors (and the round, FedProx's mu) to every client."""
        server_round += self.round_offset
        config["proximal-mu"] = self.proximal_mu
        messages = list(super().configure_train(server_round, arrays, config, grid))
        # The first round waits for every client to connect; later rounds go on with the
        # nodes still connected: a deployed node that died is dropped by the SuperLink,
        # and waiting for it would stall the run.
        self.min_available_nodes = self.min_train_nodes
        self._global = to_arrays(arrays)
        size = nbytes(self._global)
        self.rounds[server_round] = {"sent": len(messages), "bytes_down": size * len(messages)}
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop failed and malformed replies, then average the rest name by name."""
        server_round += self.round_offset
        good: list[Message] = []
        dropped: list[str] = []
        for msg in replies:
            reason = self._reject(msg)
            if reason is None:
                good.append(msg)
            else:
                dropped.append(reason)
        stats = self.rounds.setdefault(server_round, {"sent": 0, "bytes_down": 0})
        stats["dropped"] = dropped + _missing(stats["sent"], len(good) + len(dropped))
        for reason in stats["dropped"]:
            log.warning("round %d: dropped %s", server_round, reason)
        metrics = [m.content.metric_records[METRICS] for m in good]
        stats.update(
            clients=sorted(int(_number(m, "client")) for m in metrics),
            bytes_up=sum(int(_number(m, "bytes-up")) for m in metrics),
            client_time_s=[_number(m, "client-time-s") for m in metrics],
        )
        if not good:
            raise FederatedError(_nobody(server_round, stats["dropped"]))
        arrays, summary = super().aggregate_train(server_round, good)
        stats["train_loss"] = summary["train-loss"] if summary is not None else None
        if arrays is not None:
            arrays = to_record(self._finish(to_arrays(arrays), good))
        return arrays, summary

    def _finish(self, average: dict[str, Array], good: list[Message]) -> dict[str, Array]:
        """The new global state from the clients' weighted average: BatchNorm variances
        widened by the spread of the clients' means, then the server's step."""
        if self.batchnorm.pairs:
            replies = [to_arrays(m.content.array_records[ARRAYS]) for m in good]
            weights = [_number(m.content.metric_records[METRICS], "num-examples") for m in good]
            average = self.batchnorm.pool(average, replies, weights)
        return self.server.apply(self._global, average)

    def _reject(self, msg: Message) -> str | None:
        """Why a reply cannot join the aggregate (None: it can)."""
        node = msg.metadata.src_node_id
        if msg.has_error():
            return f"node {node}: {msg.error.reason}"
        try:
            record = msg.content.array_records[ARRAYS]
            self.trained.check(to_arrays(record), f"node {node}'s reply")
            sent = int(_number(msg.content.metric_records[METRICS], "bytes-up"))
            if sent != nbytes(to_arrays(record)):
                raise FederatedError(f"node {node} reports {sent} bytes, sent another amount")
        except (KeyError, FederatedError) as exc:
            return str(exc)
        return None


def _train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """The round's training loss (weighted by examples) and its slowest client's time."""
    metrics = [r.metric_records[METRICS] for r in records]
    weights = [_number(m, weight_key) for m in metrics]
    losses = [_number(m, "train-loss") for m in metrics]
    return MetricRecord(
        {
            "train-loss": sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights),
            "client-time-s": max(_number(m, "client-time-s") for m in metrics),
        }
    )


def _number(metrics: MetricRecord, key: str) -> float:
    """A scalar metric of a client's reply (a ``FederatedError`` if it is missing)."""
    value = metrics.get(key)
    if not isinstance(value, int | float):
        raise FederatedError(f"the reply's metrics lack the number {key!r}")
    return float(value)


def _nobody(server_round: int, dropped: list[str]) -> str:
    """Why a round in which no client trained ends the run (the reasons cut short)."""
    reasons = "; ".join(" ".join(r.split())[:200] for r in dropped[:3])
    more = f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
    kept = (
        f"the saved global state is that of round {server_round - 1}: fix the cause and "
        "continue with --resume"
        if server_round > 1
        else "nothing was saved: fix the cause and start again"
    )
    return (
        f"round {server_round}: no client trained ({reasons or 'no client was sent'}{more}); {kept}"
    )


def _missing(sent: int, answered: int) -> list[str]:
    """Clients that sent nothing before the round's timeout."""
    return [f"{sent - answered} client(s) did not answer in time"] if sent > answered else []
