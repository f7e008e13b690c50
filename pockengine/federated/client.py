"""The Flower ClientApp: a train message in, the trained tensors out.

Flower's Message API: the ServerApp sends a ``train`` message holding an
``ArrayRecord`` ("arrays": the global trained tensors, nothing frozen) and a
``ConfigRecord`` ("config": ``server-round``, ``proximal-mu``). The client loads them
into its compiled step, trains E local epochs on its shard and replies with an
``ArrayRecord`` of its trained tensors (partial-channel params: the trained rows only)
and a ``MetricRecord`` ("metrics": ``num-examples``, ``train-loss``,
``client-time-s``, ``bytes-up``).

The run's ``FederatedConfig`` arrives as JSON in the run config (``RUN_CONFIG_KEY``);
the client's shard is ``partition-id`` of the node config, as in Flower's examples.
The step is compiled on the first message of a process and kept for the next rounds, and
for the other clients a simulation process hosts (``--parallel`` below ``--clients``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pockengine.federated.config import FederatedConfig, FederatedError
from pockengine.federated.local import LocalTrainer
from pockengine.federated.payload import nbytes

__all__ = ["ARRAYS", "CONFIG", "METRICS", "RUN_CONFIG_KEY", "app", "to_arrays", "to_record"]

log = logging.getLogger(__name__)

RUN_CONFIG_KEY = "pockengine-config"
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"

app = ClientApp()

# One trainer per run config in this process: compiled once, reused by every round and
# by every client (partition) the process serves (``LocalTrainer.serve``).
_TRAINERS: dict[str, LocalTrainer] = {}


def to_record(arrays: dict[str, np.ndarray[Any, Any]]) -> ArrayRecord:
    """Named NumPy arrays as Flower's ``ArrayRecord`` (order kept)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})


def to_arrays(record: ArrayRecord) -> dict[str, np.ndarray[Any, Any]]:
    return {name: array.numpy() for name, array in record.items()}


def trainer_for(context: Context) -> LocalTrainer:
    """This process's trainer, serving the node's partition (compiled on first use)."""
    text = str(context.run_config[RUN_CONFIG_KEY])
    client = int(context.node_config["partition-id"])
    if text not in _TRAINERS:
        config = FederatedConfig.from_json(text)
        import torch

        torch.set_num_threads(config.threads)
        start = time.perf_counter()
        _TRAINERS[text] = LocalTrainer(config, client)
        log.info("client %d: compiled in %.1fs", client, time.perf_counter() - start)
    return _TRAINERS[text].serve(client)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of local training (see the module docstring for the records)."""
    trainer = trainer_for(context)
    config = message.content.config_records[CONFIG]
    server_round = int(_scalar(config, "server-round", None))
    _inject_faults(trainer, server_round)
    arrays = to_arrays(message.content.array_records[ARRAYS])
    result = trainer.train(arrays, server_round, _scalar(config, "proximal-mu", 0.0))
    metrics = MetricRecord(
        {
            "num-examples": result.examples,
            "train-loss": result.loss,
            "client-time-s": result.seconds,
            "bytes-up": nbytes(result.arrays),
            "client": trainer.client,
        }
    )
    content = RecordDict({ARRAYS: to_record(result.arrays), METRICS: metrics})
    return Message(content=content, reply_to=message)


def _scalar(config: ConfigRecord, key: str, default: float | None) -> float:
    """A number of the train message's config (``default`` when absent, if any)."""
    value = config.get(key, default)
    if not isinstance(value, int | float):
        raise FederatedError(f"the train message's config lacks the number {key!r}")
    return float(value)


def _inject_faults(trainer: LocalTrainer, server_round: int) -> None:
    """The ``fail``/``delay`` options of the run (tests and demonstrations)."""
    seconds = trainer.config.delay_s(trainer.client, server_round)
    if seconds:
        time.sleep(seconds)
    if trainer.config.fails(trainer.client, server_round):
        raise FederatedError(f"client {trainer.client} fails in round {server_round} (--fail)")
