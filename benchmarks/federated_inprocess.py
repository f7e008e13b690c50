"""FedAvg in one process, for diagnosis: one compiled step serves every client in turn.

    OMP_NUM_THREADS=1 python benchmarks/federated_inprocess.py --recipe lite0-fashion \\
        --image-size 32 --max-train 2000 --max-val 300 --partition dirichlet --out r.json

``pockengine federated`` runs a process per client, each compiling its own step; on a
small machine ten compiles and ten resident models cost more than the training. Here one
``LocalTrainer`` is compiled and its shard swapped per client; every round each client
trains from the global state exactly as ``LocalTrainer.train`` does in a client process
(its shard, order, learning-rate schedule, fresh optimizer moments, dropout seed,
BatchNorm statistics), and the server's side is the strategy's: the weighted average,
``BatchNormStats.pool`` and ``ServerStep``, then ``tasks.metrics.evaluate`` on the
held-out split. Only the order of the float sums in the average may differ from Flower's.
``--local-loss logit-adjusted --la-tau T`` trains each client on its own logit-adjusted
loss (its shard's prior, one more input of the shared step). ``--pooled-bn`` also scores
each round with BatchNorm statistics recomputed on the whole training split (which no
real server has): the ceiling of any statistics a client sends. ``--scaffold`` corrects
each client's drift with SCAFFOLD's control variates (Karimireddy et al. 2020, option
II), decoupled from the step as FedProx is here: after each local step the trained
tensors move by ``-lr * (c - c_i)``; after the round ``c_i += (x - y_i) / sum(lr) - c``,
and the server's ``c`` is the clients' mean. A client would send ``c_i``'s change
besides its tensors: twice the bytes up (``bytes_up`` counts both). ``--auto-on pooled``
makes ``--scheme auto``'s choice on the whole training split rather than client 0's
shard (no real server has it): the most that aggregating every client's scores could do.
Writes one JSON line per round to stdout and all of them to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pockengine.federated import FederatedConfig
from pockengine.federated.batchnorm import BatchNormStats
from pockengine.federated.local import LocalTrainer, resolve_scheme
from pockengine.federated.local_loss import LOCAL_LOSSES
from pockengine.federated.partition import partition
from pockengine.federated.server_step import SERVER_OPTIMIZERS
from pockengine.finetune import FinetuneConfig
from pockengine.tasks import recipes
from pockengine.tasks.metrics import evaluate

Array = np.ndarray[Any, Any]


def clients(config: FederatedConfig) -> tuple[list[LocalTrainer], recipes.Task]:
    """One compiled trainer per client, all sharing client 0's step; the task."""
    base = LocalTrainer(config, 0)
    task = recipes.build(base.config.finetune)
    ft = base.config.finetune
    shards = partition(task.train, config.partition, config.clients, config.alpha, ft.seed,
                       base.batch_size)  # fmt: skip
    out = []
    for c, rows in enumerate(shards):
        t = copy.copy(base)
        t.use_shard(c, tuple(a[rows] for a in task.train))  # its own prior, the shared step
        out.append(t)
    return out, task


def aggregate(replies: list[dict[str, Array]], weights: list[float],
              batchnorm: BatchNormStats) -> dict[str, Array]:  # fmt: skip
    """The strategy's weighted average, BatchNorm variances pooled."""
    w = np.asarray(weights, np.float64) / float(sum(weights))
    average: dict[str, Array] = {
        k: np.tensordot(w, np.stack([r[k].astype(np.float64) for r in replies]), axes=1)
        for k in replies[0]
    }
    if batchnorm.pairs:
        average = batchnorm.pool(average, replies, weights)
    return {k: np.asarray(v, replies[0][k].dtype) for k, v in average.items()}


def pooled_bn_accuracy(trainer: LocalTrainer, task: recipes.Task) -> float:
    """Accuracy with BatchNorm statistics recomputed on the whole training split."""
    every = BatchNormStats.of(trainer.model, list(trainer.trained.rows))
    stats = every.recompute(trainer.step, trainer.model, task.train[:-1], trainer.batch_size)
    saved = trainer.trained.extract(trainer.step)
    trainer.trained.merge(trainer.step, {**saved, **stats}, "pooled statistics")
    accuracy = evaluate(trainer.step, task).get("val_accuracy", float("nan"))
    trainer.trained.merge(trainer.step, saved, "global state")
    return accuracy


def train_scaffold(t: LocalTrainer, state: dict[str, Array], r: int, c: dict[str, Array],
                   c_i: dict[str, Array]) -> tuple[Any, dict[str, Array]]:  # fmt: skip
    """``LocalTrainer.train`` with SCAFFOLD's correction after each step; the round's
    result and the client's new control variate."""
    from pockengine.federated import local

    lrs: list[float] = []
    stats = t.trained.buffers
    one_step = t._one_step

    def corrected(rows: Array, lr: float) -> float:
        loss = one_step(rows, lr)
        lrs.append(lr)
        now = t.trained.extract(t.step)
        moved = {k: v if k in stats or k not in c else (v - lr * (c[k] - c_i[k])).astype(v.dtype)
                 for k, v in now.items()}  # fmt: skip
        t.trained.merge(t.step, moved, f"client {t.client} (SCAFFOLD)")
        return loss

    t._one_step = corrected  # type: ignore[method-assign]
    try:
        result = local.LocalTrainer.train(t, state, r, 0.0)
    finally:
        del t._one_step
    total = max(sum(lrs), 1e-12)
    new = {k: c_i[k] - c[k] + (state[k].astype(np.float64) - result.arrays[k]) / total
           for k in c}  # fmt: skip
    return result, new


def run(config: FederatedConfig, pooled_bn: bool, scaffold: bool = False) -> list[dict[str, Any]]:
    start = time.perf_counter()
    trainers, task = clients(config)
    first = trainers[0]
    recompute = config.bn_statistics == "recompute"
    batchnorm = BatchNormStats.of(first.model, list(first.trained.rows)) if recompute else None
    server = config.server_step(first.trained.buffers)
    state = first.trained.extract(first.step)
    stats = first.trained.buffers
    c = {k: np.zeros(v.shape) for k, v in state.items() if k not in stats}
    c_i = [{k: np.zeros_like(v) for k, v in c.items()} for _ in trainers]
    rows = []
    for r in range(1, config.rounds + 1):
        if scaffold:
            pairs = [train_scaffold(t, state, r, c, c_i[i]) for i, t in enumerate(trainers)]
            results = [p[0] for p in pairs]
            c = {k: c[k] + np.mean([p[1][k] - c_i[i][k] for i, p in enumerate(pairs)], axis=0)
                 for k in c}  # fmt: skip
            c_i = [p[1] for p in pairs]
        else:
            results = [t.train(state, r, config.proximal_mu) for t in trainers]
        weights = [float(x.examples) for x in results]
        average = aggregate([x.arrays for x in results], weights, batchnorm or BatchNormStats({}))
        state = server.apply(state, average)
        first.trained.merge(first.step, state, "global state")
        metrics = evaluate(first.step, task)
        row = {"round": r, "accuracy": metrics.get("val_accuracy"), "loss": metrics["val_loss"],
               "train_loss": float(np.average([x.loss for x in results], weights=weights)),
               "bytes_up": sum(a.nbytes for x in results for a in x.arrays.values())
               * (2 if scaffold else 1),
               "bytes_full_model": first.trained.full_model_bytes * len(results),
               "elapsed_s": time.perf_counter() - start}  # fmt: skip
        if pooled_bn:
            row["accuracy_pooled_bn"] = pooled_bn_accuracy(first, task)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--recipe", default="lite0-fashion")
    p.add_argument("--image-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--max-train", type=int)
    p.add_argument("--max-val", type=int)
    p.add_argument("--scheme", default="sparse")
    p.add_argument("--upload-budget", type=float, help="--scheme auto: of full-model bytes")
    p.add_argument("--memory-budget", type=float, help="--scheme auto: planned peak, MiB")
    p.add_argument(
        "--auto-on",
        choices=("client0", "pooled"),
        default="client0",
        help="--scheme auto: analyse client 0's shard (as the command does) or "
        "the whole training split (diagnosis: no real server has it)",
    )
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--partition", choices=("iid", "dirichlet"), default="dirichlet")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS, default="avg")
    p.add_argument("--server-lr", type=float)
    p.add_argument("--server-momentum", type=float, default=0.0)
    p.add_argument("--server-betas", type=float, nargs=2, default=(0.9, 0.99))
    p.add_argument("--server-tau", type=float, default=1e-3)
    p.add_argument("--bn-statistics", choices=("recompute", "running"), default="recompute")
    p.add_argument(
        "--batchnorm",
        choices=("batch", "running"),
        help="what the trained BatchNorms normalise by (finetune --batchnorm; "
        "default: the recipe's)",
    )
    p.add_argument("--proximal-mu", type=float, default=0.0, help="FedProx (decoupled)")
    p.add_argument("--local-loss", choices=LOCAL_LOSSES, default="plain")
    p.add_argument("--la-tau", type=float, default=1.0)
    p.add_argument("--pooled-bn", action="store_true", help="also score with pooled statistics")
    p.add_argument("--scaffold", action="store_true", help="SCAFFOLD's control variates")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    ft = FinetuneConfig(recipe=a.recipe, image_size=a.image_size, seq_len=a.seq_len,
                        max_train=a.max_train, max_val=a.max_val, scheme=a.scheme, lr=a.lr,
                        seed=a.seed, backend="torch", batchnorm=a.batchnorm,
                        memory_budget=a.memory_budget and a.memory_budget * 2**20)  # fmt: skip
    config = FederatedConfig(
        finetune=ft, clients=a.clients, rounds=a.rounds, local_epochs=a.local_epochs,
        partition=a.partition, alpha=a.alpha, server_optimizer=a.server_optimizer,
        server_lr=a.server_lr, server_momentum=a.server_momentum,
        server_betas=tuple(a.server_betas), server_tau=a.server_tau,
        bn_statistics=a.bn_statistics, local_loss=a.local_loss, la_tau=a.la_tau,
        proximal_mu=a.proximal_mu, upload_budget=a.upload_budget,
    )  # fmt: skip
    config = resolve_scheme(config, pooled=a.auto_on == "pooled")  # --scheme auto: once
    rows = run(config, a.pooled_bn, a.scaffold)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                 "scheme_choice": config.scheme_choice,
                                 "rounds": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
