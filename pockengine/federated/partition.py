"""Cutting the training split into client shards: IID or Dirichlet label skew.

Each shard is a sorted array of row indices into the training split, so one client
with IID data holds the split exactly in its original order (and trains exactly as
``pockengine finetune`` does). ``dirichlet`` draws, for every class, the share of
each client from Dirichlet(alpha) (Hsu et al., 2019): alpha 0.5 leaves most clients
with a few dominant classes. Draws that leave a client with less than one batch are
redrawn (from the same seeded generator), so the result is reproducible.
"""

from __future__ import annotations

import numpy as np

from pockengine.federated.config import FederatedError
from pockengine.ir.arrays import Array

__all__ = ["dirichlet", "iid", "partition"]
_DRAWS = 100


def iid(n: int, clients: int, seed: int) -> list[Array]:
    """``clients`` shards of a seeded permutation of ``range(n)``, sizes within one."""
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(part) for part in np.array_split(order, clients)]


def dirichlet(labels: Array, clients: int, alpha: float, seed: int, least: int) -> list[Array]:
    """Label-skewed shards: class ``c``'s rows split among clients by Dirichlet(alpha)
    shares; every shard gets at least ``least`` rows or the split is drawn again."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(_DRAWS):
        parts: list[list[Array]] = [[] for _ in range(clients)]
        for c in classes:
            rows = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(rows)).astype(int)
            for client, chunk in enumerate(np.split(rows, cuts)):
                parts[client].append(chunk)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= least:
            return shards
    raise FederatedError(
        f"no Dirichlet(alpha={alpha}) split of {len(labels)} examples over {clients} clients "
        f"gave every client one batch ({least}) in {_DRAWS} draws: use fewer clients, a "
        "larger --alpha, more data or a smaller --batch-size"
    )


def partition(
    train: tuple[Array, ...], kind: str, clients: int, alpha: float, seed: int, least: int
) -> list[Array]:
    """The shards of a training split (its last array holds the labels); a
    ``FederatedError`` with the numbers when the clients outnumber its batches."""
    n = len(train[0])
    if clients > n // least:
        raise FederatedError(
            f"{n} training examples make {n // least} batch(es) of {least}, fewer than the "
            f"{clients} clients, each of which needs at least one: {_fewer(n, least)}"
        )
    if kind == "iid":
        shards = iid(n, clients, seed)
    elif len(train) < 2 or train[-1].ndim != 1:
        raise FederatedError("--partition dirichlet needs class labels; this task has none")
    else:
        shards = dirichlet(train[-1], clients, alpha, seed, least)
    small = [i for i, s in enumerate(shards) if len(s) < least]
    if small:
        raise FederatedError(
            f"{n} training examples over {clients} clients leave client(s) {small} with "
            f"fewer than one batch of {least}: use fewer clients or more data"
        )
    return shards


def _fewer(n: int, least: int) -> str:
    """What to change when ``n`` examples do not give every client a batch of ``least``."""
    if n < least:
        return "use a smaller --batch-size or more data (--max-train, --val-fraction)"
    return (
        f"use --clients {n // least} or fewer, a smaller --batch-size, or more data "
        "(--max-train, --val-fraction)"
    )
