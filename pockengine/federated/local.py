"""One client's local training: a compiled PockEngine step over its shard.

``LocalTrainer`` builds the recipe's task, cuts its shard of the training split and
compiles one ``TrainStep`` for the fixed batch shape: once per client process, then
reused every round (``load_state`` receives the global trained tensors). A round runs
E local epochs in the order ``pockengine finetune`` uses (``epoch_order(n, seed,
epoch)``, the last partial batch dropped), with the learning rate schedule of the whole
federated run (warmup, then linear decay over all rounds' local steps), and fresh
optimizer moments each round; the dropout seed advances one a step across rounds, as
if the client had never stopped. So one client with IID data, one round, runs exactly
the steps of ``pockengine finetune``, and a resumed run repeats the rounds it redoes.

FedProx (``proximal_mu`` > 0): a compiled step's loss is fixed, so the proximal term
is applied decoupled, as AdamW applies weight decay: after each step, ``w -= lr * mu *
(w - w_global)`` on the trained tensors (their trained rows).

``local_loss`` "logit-adjusted" compiles ``federated.local_loss.logit_adjusted_loss``
instead of the task's loss: the client's ``tau * log p`` (its shard's label prior) is
one more batch input, so the one compiled step serves any shard.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.federated.batchnorm import BatchNormStats
from pockengine.federated.config import FederatedConfig, FederatedError
from pockengine.federated.local_loss import adjusted_batch, local_loss_fn, logit_bias
from pockengine.federated.partition import partition
from pockengine.federated.payload import TrainedSet, load_some
from pockengine.federated.run_folder import GLOBAL_STATE, out_dir
from pockengine.ir.arrays import Array
from pockengine.optim import linear_schedule
from pockengine.safetensors_io import read_metadata
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.step.compiler import TrainStep
from pockengine.tasks import data as ds
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig

__all__ = [
    "LocalResult",
    "LocalTrainer",
    "check_shards",
    "client_shards",
    "prepare",
    "resolve_scheme",
    "scheme_of",
    "seed_offset",
]

log = logging.getLogger(__name__)
RNG_SEED = "rng.seed"
AUTO = "auto"


def prepare(
    config: FederatedConfig, checked: Callable[[], object] | None = None
) -> tuple[FederatedConfig, recipes.Task, TrainStep]:
    """The config with the recipe's defaults (and ``--scheme auto`` resolved), its task,
    and its compiled step. ``checked`` is called once the task is built and every client
    is known to get a batch, before the compile (the server lists its nodes there, which
    starts the simulation's client processes beside the compile)."""
    config = with_defaults(config)
    ft = config.finetune
    recipes.check_model_files(ft)
    task = recipes.build(ft)
    client_shards(config, task)
    if checked is not None:
        checked()
    config = resolve_scheme(config, task)
    return config, task, compile_task(ft, task, scheme_of(config), config.local_loss)


def client_shards(config: FederatedConfig, task: recipes.Task) -> list[Array]:
    """The rows of the training split each client trains on; a ``FederatedError`` with
    the numbers when a client would get less than one batch (checked by the server before
    any client process starts)."""
    ft = config.finetune
    assert ft.batch_size is not None
    return partition(
        task.train, config.partition, config.clients, config.alpha, ft.seed, ft.batch_size
    )


def check_shards(config: FederatedConfig) -> None:
    """``client_shards`` on the task's training split, before anything starts (the task
    is built here: a deployment has no server process yet)."""
    full = with_defaults(config)
    recipes.check_model_files(full.finetune)
    client_shards(full, recipes.build(full.finetune))


def with_defaults(config: FederatedConfig) -> FederatedConfig:
    """``config`` checked, with the recipe's defaults filled in (its scheme ``sparse``
    where the fine-tuner's is ``auto``)."""
    config = config.validate()
    ft = config.finetune
    ft = ft.with_defaults(recipes.defaults(ft, auto=False)).validate()
    config = dataclasses.replace(config, finetune=ft)
    if config.upload_budget is not None and ft.scheme != AUTO:
        raise FederatedError(
            f"--upload-budget limits what --scheme auto chooses; the scheme {ft.scheme!r} "
            "sends what it trains"
        )
    return config


def scheme_of(config: FederatedConfig) -> Scheme:
    """The scheme every client trains: the one ``auto`` chose, or the one named."""
    ft = config.finetune
    assert ft.scheme is not None
    if ft.scheme == AUTO:
        if config.scheme_choice is None:
            raise FederatedError("--scheme auto: no scheme was chosen (resolve_scheme)")
        return schemes.from_dict(config.scheme_choice)
    return recipes.parse_scheme(ft.scheme, ft.recipe, ft.batchnorm)


def resolve_scheme(
    config: FederatedConfig, task: recipes.Task | None = None, *, pooled: bool = False
) -> FederatedConfig:
    """``--scheme auto`` chosen once for the whole federation: the fine-tuner's analysis
    (``choose_auto``: the gradient estimate, then the budgeted search) run on client 0's
    shard, as one device would on its own data, under the memory budget and, with
    ``upload_budget``, at most that fraction of full-model FedAvg's bytes in trained
    elements. The choice (parameter names and trained rows, no data) travels to every
    client and the server in the config. A resumed run keeps the choice it saved.
    ``config`` unchanged for any other scheme, or where the choice is made. ``pooled``
    (diagnosis only, ``benchmarks/federated_inprocess.py --auto-on pooled``): the whole
    training split instead, which no real server has: the most that aggregating every
    client's scores could reach."""
    full = with_defaults(config)
    ft = full.finetune
    if ft.scheme != AUTO or config.scheme_choice is not None:
        return config
    if config.resume and (saved := _saved_choice(full)) is not None:
        return dataclasses.replace(config, scheme_choice=saved)
    from pockengine.scheme_choice.auto_scheme import choose_auto

    if task is None:
        recipes.check_model_files(ft)
        task = recipes.build(ft)
    assert ft.batch_size is not None
    local = task
    if not pooled:
        shards = partition(
            task.train, full.partition, full.clients, full.alpha, ft.seed, ft.batch_size
        )
        mine = tuple(np.ascontiguousarray(a[shards[0]]) for a in task.train)
        local = dataclasses.replace(task, train=mine, train_count=0, train_digest="")
    limit = None
    if full.upload_budget is not None:
        limit = full.upload_budget * full_model_floats(task.model)
    sparse = recipes.RECIPES[recipes.recipe_name(ft)].sparse
    choice = choose_auto(ft, local, sparse, upload_limit=limit)
    for line in choice.lines():
        log.info("%s", line.strip())
    return dataclasses.replace(config, scheme_choice=choice.scheme.to_dict())


def full_model_floats(model: Any) -> float:
    """What full-model FedAvg sends, counted in float32 elements: every entry of the
    model's state (tied weights under each name), at its own width."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 4


def _saved_choice(config: FederatedConfig) -> dict[str, Any] | None:
    """The scheme choice in the saved global state's config, if there is one."""
    try:
        header = read_metadata(out_dir(config) / GLOBAL_STATE)
        saved: dict[str, Any] | None = json.loads(header["config"]).get("scheme_choice")
    except (OSError, ValueError, KeyError):
        return None
    return saved


def compile_task(
    ft: FinetuneConfig, task: recipes.Task, scheme: Scheme, local_loss: str = "plain"
) -> TrainStep:
    """The step ``pockengine finetune`` compiles for this task (same optimizer, batch
    shape, backend; dropout on, its seed the step's ``rng.seed`` state); with
    ``local_loss`` "logit-adjusted", its loss takes a last ``[batch, classes]`` bias."""
    import torch

    from pockengine.step.compiler import compile

    assert ft.batch_size is not None
    batch = tuple(np.ascontiguousarray(a[: ft.batch_size]) for a in task.train)
    if local_loss == "logit-adjusted":
        _check_adjustable(task)
        batch = adjusted_batch(batch, np.zeros(len(task.labels), np.float32))
    task.model.train()
    opt = ft.make_optimizer()
    loss_fn = local_loss_fn(local_loss, task.loss_fn)
    return compile(
        task.model,
        loss_fn,
        tuple(torch.from_numpy(a) for a in batch),
        optimizer=opt,
        scheme=scheme,
        backend=ft.backend,
        compile_in="process",  # a client process beside Flower's gRPC threads: never fork
    )


def _check_adjustable(task: recipes.Task) -> None:
    """The logit adjustment needs a classifier whose loss is cross-entropy of its logits."""
    if task.kind != "classify" or task.loss_fn is not recipes.classify_loss:
        raise FederatedError(
            f"--local-loss logit-adjusted needs a classification task whose loss is the "
            f"cross-entropy of the model's logits; {task.name!r} is a {task.kind} task "
            f"with the loss {getattr(task.loss_fn, '__name__', task.loss_fn)}"
        )


def seed_offset(client: int) -> int:
    """What a client adds to the run's seed (data order) and to the dropout seed, so that
    clients draw differently; 0 for client 0, which then trains as ``finetune`` does."""
    return 1_000_003 * client


@dataclass
class LocalResult:
    """One round of a client: its trained tensors, examples seen, mean loss, seconds."""

    arrays: dict[str, Array]
    examples: int
    loss: float
    seconds: float


class LocalTrainer:
    """The compiled step, the shard and the counters of one client process."""

    def __init__(self, config: FederatedConfig, client: int) -> None:
        config, task, step = prepare(config)
        ft = config.finetune
        assert ft.batch_size is not None
        self.shards = client_shards(config, task)
        self.config, self.step, self.batch_size = config, step, ft.batch_size
        self.classes, self.split = len(task.labels), task.train
        self.use_shard(client, tuple(a[self.shards[client]] for a in task.train))
        self.trained = TrainedSet.of(step)
        self.model, self.kind = task.model, task.kind
        self.batchnorm = BatchNormStats.of(task.model, list(self.trained.rows))
        self._fresh = step.optimizer_state()

    def serve(self, client: int) -> LocalTrainer:
        """``self``, training as ``client`` on its shard (a process that hosts several
        clients shares one compiled step among them: every round starts from the global
        tensors and fresh optimizer moments, so nothing of one client reaches another)."""
        if client != self.client:
            self.use_shard(client, tuple(a[self.shards[client]] for a in self.split))
        return self

    def use_shard(self, client: int, shard: tuple[Array, ...]) -> None:
        """Train as ``client`` on ``shard`` (inputs..., labels): its step counts, its
        schedule and, for the logit-adjusted loss, its label prior."""
        config, ft = self.config, self.config.finetune
        self.client, self.shard = client, tuple(np.ascontiguousarray(a) for a in shard)
        self.steps_per_epoch = len(self.shard[0]) // self.batch_size
        self.steps_per_round = config.local_epochs * self.steps_per_epoch
        self.total = config.rounds * self.steps_per_round
        self.warmup = round(ft.warmup * self.total)
        self.logit_bias = (
            logit_bias(self.shard[-1], self.classes, config.la_tau)
            if config.local_loss == "logit-adjusted"
            else None
        )

    def train(self, arrays: dict[str, Array], server_round: int, mu: float) -> LocalResult:
        """E local epochs from the global ``arrays``; the trained tensors after them."""
        start = time.perf_counter()
        self.trained.merge(self.step, arrays, f"client {self.client}, round {server_round}")
        load_some(
            self.step, optimizer=self._round_start(server_round), where=f"client {self.client}"
        )
        ft = self.config.finetune
        losses = []
        for e in range(self.config.local_epochs):
            epoch = (server_round - 1) * self.config.local_epochs + e
            order = ds.epoch_order(len(self.shard[0]), ft.seed + seed_offset(self.client), epoch)
            for b in range(self.steps_per_epoch):
                t = (server_round - 1) * self.steps_per_round + e * self.steps_per_epoch + b
                lr = linear_schedule(t, float(ft.lr or 0.0), self.warmup, self.total)
                losses.append(self._one_step(order[b * self.batch_size :][: self.batch_size], lr))
                if mu > 0:
                    self._proximal(arrays, lr * mu)
        return LocalResult(
            self._sent(),
            self.steps_per_round * self.batch_size,
            float(np.mean(losses)),
            time.perf_counter() - start,
        )

    def _sent(self) -> dict[str, Array]:
        """The trained tensors, BatchNorm statistics recomputed on the shard if asked."""
        arrays = self.trained.extract(self.step)
        if self.config.bn_statistics == "recompute" and self.batchnorm.pairs:
            inputs = self.shard[:-1] if self.kind == "classify" else self.shard
            arrays.update(self.batchnorm.recompute(self.step, self.model, inputs, self.batch_size))
        return arrays

    def _round_start(self, server_round: int) -> dict[str, Array]:
        """Fresh optimizer moments; the dropout seed where a client that had run every
        earlier round would be (distinct per client), so a resumed run repeats it."""
        state = dict(self._fresh)
        if RNG_SEED in state:
            done = (server_round - 1) * self.steps_per_round
            state[RNG_SEED] = state[RNG_SEED] + seed_offset(self.client) + done
        return state

    def _one_step(self, rows: Array, lr: float) -> float:
        self.step.lr = lr
        batch = tuple(np.ascontiguousarray(a[rows]) for a in self.shard)
        if self.logit_bias is not None:
            batch = adjusted_batch(batch, self.logit_bias)
        loss = self.step(*batch)
        if not math.isfinite(loss):
            raise FederatedError(
                f"client {self.client}: the loss is {loss}; try a lower --lr than "
                f"{self.config.finetune.lr}"
            )
        return loss

    def _proximal(self, global_arrays: dict[str, Array], weight: float) -> None:
        """FedProx's pull towards the round's global tensors, decoupled from the step;
        statistics (BatchNorm's) are not trained and are not pulled."""
        now = self.trained.extract(self.step)
        stats, g = self.trained.buffers, global_arrays
        pulled = {k: v if k in stats else v - weight * (v - g[k]) for k, v in now.items()}
        self.trained.merge(self.step, pulled, f"client {self.client} (FedProx)")
