"""The Flower ServerApp: the global trained tensors, central evaluation, the round log.

The server builds the same task and compiled step as its clients (the recipe fixes the
frozen weights, so only the trained tensors ever travel), starts ``SparseFedAvg`` from
the step's trained tensors and, after each round, evaluates the aggregate centrally on
the held-out validation split, appends a line to ``rounds.jsonl`` and saves the global
trained tensors to ``global.safetensors`` (atomically). ``resume`` starts from that
file after its last round, so a server that stopped continues where it was.

``rounds.jsonl``: ``round``, ``accuracy``, ``loss`` (central), ``bytes_up``,
``bytes_down``, ``bytes_full_model`` (what full-model FedAvg would have sent up in the
round: every param and buffer from each client that answered), ``clients``,
``dropped``, ``client_time_s`` (max over clients), ``train_loss`` and ``elapsed_s``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from pockengine.federated.batchnorm import BatchNormStats
from pockengine.federated.client import RUN_CONFIG_KEY, to_arrays, to_record
from pockengine.federated.config import FederatedConfig, FederatedError
from pockengine.federated.local import prepare
from pockengine.federated.payload import TrainedSet
from pockengine.federated.run_folder import GLOBAL_STATE, ROUNDS, SUMMARY, out_dir
from pockengine.federated.server_step import ServerStep
from pockengine.federated.strategy import SparseFedAvg
from pockengine.finetune.run_folder.checkpoint import write_json_lines
from pockengine.finetune.run_folder.metrics_log import MetricsLog
from pockengine.safe_write import write_bytes
from pockengine.safetensors_io import metadata_of
from pockengine.step.compiler import TrainStep
from pockengine.tasks.metrics import evaluate
from pockengine.tasks.recipes import Task

__all__ = ["GLOBAL_STATE", "ROUNDS", "SUMMARY", "app", "out_dir", "run_server"]

log = logging.getLogger(__name__)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's entry point: the run's config travels in the run config."""
    run_server(grid, FederatedConfig.from_json(str(context.run_config[RUN_CONFIG_KEY])))


def run_server(grid: Grid, config: FederatedConfig) -> dict[str, Any]:
    """Every round of the run (or the rest of a resumed one); returns the summary."""
    start = time.perf_counter()
    # every client gets a batch before any client process starts (``ProcessGrid`` starts
    # them when first asked for its nodes)
    config, task, step = prepare(config, grid.get_node_ids if grid is not None else None)
    out = out_dir(config)
    trained = TrainedSet.of(step)
    server = config.server_step(trained.buffers)
    done, arrays = _start_state(config, out, trained, step, server)
    round_log = _RoundLog(config, task, step, trained, out, start)
    recompute = config.bn_statistics == "recompute"
    batchnorm = BatchNormStats.of(task.model, list(trained.rows)) if recompute else None
    strategy = SparseFedAvg(
        trained,
        config.clients,
        config.proximal_mu,
        round_offset=done,
        server=server,
        batchnorm=batchnorm,
    )
    last = min(config.rounds, config.stop_after_round or config.rounds)
    if done < last:
        strategy.start(
            grid,
            to_record(arrays),
            num_rounds=last - done,
            timeout=config.timeout,
            evaluate_fn=lambda r, record: round_log.after_round(r, done, record, strategy),
        )
    else:
        round_log.initial = round_log.evaluate(arrays)
    summary = round_log.summary(done)
    write_bytes(out / SUMMARY, json.dumps(summary, indent=2).encode())
    return summary


def _start_state(
    config: FederatedConfig, out: Path, trained: TrainedSet, step: TrainStep, server: ServerStep
) -> tuple[int, dict[str, np.ndarray[Any, Any]]]:
    """(rounds done, global trained tensors): from the saved state on resume (which
    also restores the server step's moments)."""
    path = out / GLOBAL_STATE
    if not config.resume:
        if path.exists():
            raise FederatedError(f"{out} holds a federated run: continue it with --resume")
        for stale in (ROUNDS, SUMMARY):
            (out / stale).unlink(missing_ok=True)
        return 0, trained.extract(step)
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FederatedError(f"--resume: no saved global state at {path}") from None
    try:
        header = metadata_of(data)
        saved, done, tensors = json.loads(header["config"]), int(header["round"]), load(data)
    except (ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise FederatedError(f"--resume: {path} is not a saved global state ({exc})") from None
    if not config.trains_as_saved(saved):
        raise FederatedError(f"--resume: {path} was saved by a run with other options")
    arrays = server.load_state(tensors)
    trained.check(arrays, str(path))
    rows = MetricsLog(out / ROUNDS).rows()
    write_json_lines(out / ROUNDS, [row for row in rows if int(row["round"]) <= done])
    return done, arrays


class _RoundLog:
    """Central evaluation, the JSONL log and the saved state, round after round."""

    def __init__(
        self,
        config: FederatedConfig,
        task: Task,
        step: TrainStep,
        trained: TrainedSet,
        out: Path,
        start: float,
    ) -> None:
        self.config, self.task, self.step, self.trained = config, task, step, trained
        self.out, self.start = out, start
        self.log = MetricsLog(out / ROUNDS)
        self.initial: dict[str, float] = {}

    def evaluate(self, arrays: dict[str, np.ndarray[Any, Any]]) -> dict[str, float]:
        self.trained.merge(self.step, arrays, "global state")
        metrics = evaluate(self.step, self.task)
        return {"accuracy": metrics.get("val_accuracy", float("nan")), "loss": metrics["val_loss"]}

    def after_round(
        self, r: int, done: int, record: ArrayRecord, strategy: SparseFedAvg
    ) -> MetricRecord:
        """Strategy's ``evaluate_fn``: evaluate, log and save the aggregate of its round
        ``r`` (run round ``r + done``); its round 0 is the starting state."""
        arrays = to_arrays(record)
        metrics = self.evaluate(arrays)
        if r == 0:
            self.initial = metrics
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        r += done
        stats = strategy.rounds.get(r, {})
        times = stats.get("client_time_s", [])
        row = {
            "round": r,
            **metrics,
            "bytes_up": stats.get("bytes_up", 0),
            "bytes_down": stats.get("bytes_down", 0),
            "bytes_full_model": self.trained.full_model_bytes * len(stats.get("clients", [])),
            "clients": stats.get("clients", []),
            "dropped": stats.get("dropped", []),
            "client_time_s": max(times, default=0.0),
            "train_loss": stats.get("train_loss"),
            "elapsed_s": time.perf_counter() - self.start,
        }
        self._save(r, arrays, strategy.server.state())
        self.log.append(row)
        log.info(
            "round %d/%d: accuracy %.4f, loss %.4f, up %d B (full model %d B), %d client(s)%s",
            r,
            self.config.rounds,
            row["accuracy"],
            row["loss"],
            row["bytes_up"],
            row["bytes_full_model"],
            len(row["clients"]),
            f", dropped {len(row['dropped'])}" if row["dropped"] else "",
        )
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    def _save(
        self,
        r: int,
        arrays: dict[str, np.ndarray[Any, Any]],
        server_state: dict[str, np.ndarray[Any, Any]],
    ) -> None:
        """The global state and the server optimizer's moments (``ServerStep.state``,
        named apart from the trained tensors), in one atomic file."""
        from safetensors.numpy import save

        meta = {"round": str(r), "config": json.dumps(self.config.training_dict())}
        write_bytes(self.out / GLOBAL_STATE, save({**arrays, **server_state}, metadata=meta))

    def summary(self, resumed_at: int) -> dict[str, Any]:
        rows = self.log.rows()
        up = sum(r["bytes_up"] for r in rows)
        full = sum(r["bytes_full_model"] for r in rows)
        return {
            "config": json.loads(self.config.to_json()),
            "initial": self.initial,
            "final": {k: rows[-1][k] for k in ("accuracy", "loss")} if rows else self.initial,
            "rounds": len(rows),
            "resumed_at": resumed_at,
            "trained_tensors": {k: list(v) for k, v in self.trained.shapes.items()},
            "bytes_up": up,
            "bytes_full_model": full,
            "up_ratio": up / full if full else None,
            "wall_s": time.perf_counter() - self.start,
        }
