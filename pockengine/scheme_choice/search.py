"""Which parameters to train under a budget: grouped knapsack over measured candidates.

A contribution table (``pockengine.scheme_choice.sensitivity`` measures one) lists
candidate updates: the biases of a layer, or the weight of a layer at an output-channel
ratio, each with its contribution (validation-accuracy gain of a short fine-tune) and
its extra cost (bytes of the planned peak, backward FLOPs) over a baseline. A layer's
weight takes at most one ratio; its biases are chosen independently. ``choose`` picks
the set of candidates with the largest summed contribution whose summed cost fits the
budgets: branch and bound with the multiple-choice LP bound where that finishes within
``node_limit`` nodes (exact), an evolutionary search (as the paper) where it does not.

Costs are not additive (two candidates may share saved activations; the planned peak is
a maximum over time, not a sum), so ``fit_to_budget`` measures the chosen set with the
compiler and drops the candidate of least contribution per unit of the exceeded cost
until the measured cost fits, then adds back what still fits. Nothing imports torch.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pockengine.ir import SchemeError
from pockengine.sparse.schemes import Scheme, select

__all__ = [
    "Budget",
    "Item",
    "Selection",
    "brute_force",
    "choose",
    "evolve",
    "fit_to_budget",
    "group_items",
    "knapsack",
    "scheme_for",
]

COSTS = ("memory", "flops", "trained")  # planned peak bytes, backward FLOPs, trained elements


@dataclass(frozen=True)
class Item:
    """One candidate: ``group`` allows at most one item chosen; ``cost`` per COSTS name."""

    key: str
    group: str
    value: float
    cost: Mapping[str, float]
    params: tuple[str, ...] = ()
    ratio: float = 1.0  # output-channel ratio of a weight candidate


@dataclass(frozen=True)
class Budget:
    """Limits on the whole scheme's cost (None: no limit), and the part every scheme pays."""

    limits: Mapping[str, float | None]
    base: Mapping[str, float] = field(default_factory=dict)

    def room(self) -> dict[str, float]:
        """What is left for the candidates, for each limited cost."""
        return {
            k: float(v) - float(self.base.get(k, 0.0))
            for k, v in self.limits.items()
            if v is not None
        }

    def exceeded(self, measured: Mapping[str, float]) -> list[str]:
        return [k for k, v in self.limits.items() if v is not None and measured[k] > v]


@dataclass(frozen=True)
class Selection:
    items: tuple[Item, ...]
    exact: bool  # proven optimal for the estimated (additive) costs

    @property
    def value(self) -> float:
        return sum(i.value for i in self.items)

    def cost(self, name: str) -> float:
        return sum(_cost(i, name) for i in self.items)


def _cost(item: Item, name: str) -> float:
    return max(0.0, float(item.cost.get(name, 0.0)))  # a saving is not counted on


def group_items(items: Sequence[Item]) -> list[list[Item]]:
    """Items by group, in first-seen order; items that cannot help are dropped."""
    groups: dict[str, list[Item]] = {}
    for item in items:
        if item.value > 0:
            groups.setdefault(item.group, []).append(item)
    return [g for g in groups.values() if g]


def _fits(items: Sequence[Item], room: Mapping[str, float]) -> bool:
    return all(sum(_cost(i, k) for i in items) <= cap + 1e-9 for k, cap in room.items())


# -- exact: branch and bound ---------------------------------------------------------


def _increments(group: Sequence[Item], name: str) -> list[tuple[float, float]]:
    """(cost, value) steps along the upper convex hull of the group's options and "none"
    (the multiple-choice LP relaxation, Sinha & Zoltners): slopes fall step by step."""
    points = sorted({(_cost(i, name), i.value) for i in group} | {(0.0, 0.0)})
    hull: list[tuple[float, float]] = [(0.0, 0.0)]
    for c, v in points:
        if v <= hull[-1][1]:
            continue
        if c <= hull[-1][0]:  # at least as much value for no more cost
            hull[-1] = (hull[-1][0], v)
            continue
        while len(hull) >= 2:
            (c0, v0), (c1, v1) = hull[-2], hull[-1]
            if (v1 - v0) * (c - c0) <= (v - v0) * (c1 - c0):
                hull.pop()
            else:
                break
        hull.append((c, v))
    free = [(0.0, hull[0][1])] if hull[0][1] > 0 else []  # an option that costs nothing
    return free + [(c1 - c0, v1 - v0) for (c0, v0), (c1, v1) in itertools.pairwise(hull)]


def _lp_bound(steps: Sequence[tuple[float, float]], capacity: float) -> float:
    """Greedy fractional fill of ``steps`` (sorted by value per cost, falling)."""
    total = 0.0
    for c, v in steps:
        if c <= capacity:
            total += v
            capacity -= c
        else:
            return total + v * capacity / c
    return total


def knapsack(
    groups: Sequence[Sequence[Item]], room: Mapping[str, float], node_limit: int = 200_000
) -> Selection | None:
    """The best selection (at most one item a group) within ``room`` for every cost; None
    if the search needed more than ``node_limit`` nodes."""
    order = sorted(groups, key=lambda g: -max(i.value for i in g))
    names = list(room) or ["memory"]
    # suffix[d][k]: the LP steps of groups d.. for cost k, sorted by value per cost
    suffix = []
    for d in range(len(order) + 1):
        per_cost = {}
        for k in names:
            steps = [s for g in order[d:] for s in _increments(g, k)]
            per_cost[k] = sorted(steps, key=lambda s: -(s[1] / s[0]) if s[0] > 0 else -math.inf)
        suffix.append(per_cost)
    best: list[Item] = []
    best_value = 0.0
    nodes = 0
    chosen: list[Item] = []

    def bound(depth: int, left: Mapping[str, float]) -> float:
        if not room:
            return sum(max(i.value for i in g) for g in order[depth:])
        return min(_lp_bound(suffix[depth][k], left[k]) for k in names)

    def visit(depth: int, value: float, left: dict[str, float]) -> bool:
        nonlocal best, best_value, nodes
        nodes += 1
        if nodes > node_limit:
            return False
        if value > best_value:
            best, best_value = list(chosen), value
        if depth == len(order) or value + bound(depth, left) <= best_value + 1e-12:
            return True
        for item in sorted(order[depth], key=lambda i: -i.value):
            after = {k: left[k] - _cost(item, k) for k in left}
            if all(v >= -1e-9 for v in after.values()):
                chosen.append(item)
                done = visit(depth + 1, value + item.value, after)
                chosen.pop()
                if not done:
                    return False
        return visit(depth + 1, value, left)

    if not visit(0, 0.0, dict(room)):
        return None
    return Selection(tuple(best), exact=True)


def brute_force(groups: Sequence[Sequence[Item]], room: Mapping[str, float]) -> Selection:
    """Every combination (for tests and tiny problems)."""
    best: tuple[Item, ...] = ()
    for combo in itertools.product(*[[None, *g] for g in groups]):
        items = tuple(i for i in combo if i is not None)
        if _fits(items, room) and sum(i.value for i in items) > sum(i.value for i in best):
            best = items
    return Selection(best, exact=True)


# -- evolutionary --------------------------------------------------------------------


def _density(item: Item, room: Mapping[str, float]) -> float:
    """Value per unit of cost, each cost as a fraction of its room."""
    used = sum(_cost(item, k) / cap for k, cap in room.items() if cap > 0)
    return item.value / used if used > 0 else math.inf


def _repair(
    genome: list[int], groups: Sequence[Sequence[Item]], room: Mapping[str, float]
) -> list[int]:
    """Drop the chosen item of least value per cost until the genome fits."""
    while True:
        items = [(g, groups[g][c - 1]) for g, c in enumerate(genome) if c]
        if _fits([i for _, i in items], room):
            return genome
        g, _ = min(items, key=lambda gi: _density(gi[1], room))
        genome[g] = 0


def evolve(
    groups: Sequence[Sequence[Item]],
    room: Mapping[str, float],
    *,
    population: int = 64,
    generations: int = 200,
    mutation: float | None = None,
    seed: int = 0,
) -> Selection:
    """Evolutionary search: genomes hold one choice a group (0: none), are repaired to fit,
    and breed by uniform crossover and mutation; the best half survives each generation."""
    rng = random.Random(seed)
    n = len(groups)
    rate = mutation if mutation is not None else 1.0 / max(1, n)

    def fitness(genome: Sequence[int]) -> float:
        return sum(groups[g][c - 1].value for g, c in enumerate(genome) if c)

    def random_genome() -> list[int]:
        return _repair([rng.randrange(len(g) + 1) for g in groups], groups, room)

    greedy = [0] * n  # seed the population with the greedy fill by value per cost
    for g, item in sorted(
        ((g, i) for g, grp in enumerate(groups) for i in grp),
        key=lambda gi: -_density(gi[1], room),
    ):
        trial = list(greedy)
        if not trial[g]:
            trial[g] = groups[g].index(item) + 1
            if _fits([groups[h][c - 1] for h, c in enumerate(trial) if c], room):
                greedy = trial
    pool = [greedy] + [random_genome() for _ in range(population - 1)]
    for _ in range(generations):
        pool.sort(key=fitness, reverse=True)
        parents = pool[: max(2, population // 2)]
        children: list[list[int]] = []
        while len(parents) + len(children) < population:
            a, b = rng.sample(parents, 2)
            child = [x if rng.random() < 0.5 else y for x, y in zip(a, b, strict=True)]
            for g in range(n):
                if rng.random() < rate:
                    child[g] = rng.randrange(len(groups[g]) + 1)
            children.append(_repair(child, groups, room))
        pool = parents + children
    best = max(pool, key=fitness)
    return Selection(tuple(groups[g][c - 1] for g, c in enumerate(best) if c), exact=False)


def choose(
    items: Sequence[Item], budget: Budget, *, node_limit: int = 200_000, seed: int = 0
) -> Selection:
    """The best selection for the estimated costs: exact where branch and bound finishes
    within ``node_limit`` nodes, evolutionary search otherwise."""
    room = budget.room()
    short = {k: v for k, v in room.items() if v < 0}
    if short:
        raise SchemeError(
            f"the budget is below what the baseline alone costs: {_describe(budget, short)}"
        )
    groups = group_items(items)
    exact = knapsack(groups, room, node_limit)
    return exact if exact is not None else evolve(groups, room, seed=seed)


def _describe(budget: Budget, short: Mapping[str, float]) -> str:
    return ", ".join(
        f"{k} {budget.base.get(k, 0.0):.4g} > limit {budget.limits[k]:.4g}" for k in short
    )


# -- against the compiler ------------------------------------------------------------


def scheme_for(base_params: Sequence[str], items: Sequence[Item]) -> Scheme:
    """A select scheme: the base params (the head) and the chosen candidates' params, each
    weight at its channel ratio; frozen BatchNorms run on running statistics."""
    train = list(dict.fromkeys([*base_params, *(p for i in items for p in i.params)]))
    channels = {p: i.ratio for i in items if i.ratio < 1 for p in i.params}
    return select(train=train, channels=channels, frozen_bn="eval")


def fit_to_budget(
    selection: Selection,
    items: Sequence[Item],
    budget: Budget,
    measure: Callable[[Sequence[Item]], Mapping[str, float]],
    *,
    max_additions: int = 16,
) -> tuple[tuple[Item, ...], dict[str, float]]:
    """Measure the chosen items with the compiler (``measure``: item set -> cost of the
    whole scheme, per COSTS name), drop the item of least value per unit of the exceeded
    cost until the measurement fits the budget, then try to add the best of the others
    (at most ``max_additions`` tries), keeping each that still fits when measured."""
    chosen = list(selection.items)
    measured = dict(measure(chosen))
    while over := budget.exceeded(measured):
        if not chosen:
            raise SchemeError(f"the baseline alone exceeds the budget: {measured} > {budget}")
        dims = {k: 1.0 for k in over}
        worst = min(chosen, key=lambda i: _density(i, dims))
        chosen.remove(worst)
        measured = dict(measure(chosen))
    used = {i.group for i in chosen}
    room = {k: 1.0 for k, v in budget.limits.items() if v is not None}
    spare = sorted(
        (i for i in items if i.group not in used and i.value > 0),
        key=lambda i: -_density(i, room),
    )
    for item in spare[:max_additions]:
        if item.group in used:
            continue
        trial = dict(measure([*chosen, item]))
        if not budget.exceeded(trial):
            chosen.append(item)
            used.add(item.group)
            measured = trial
    return tuple(chosen), measured
