"""Scheme search under a budget: exact and evolutionary optima against brute force, and
a budget that the compiler's own report confirms on a real (small) model."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.frontend.torch import torch_model_info
from pockengine.ir import SchemeError
from pockengine.plan.report import analyze
from pockengine.scheme_choice.scheme_search import parse_amount
from pockengine.scheme_choice.search import (
    Budget,
    Item,
    Selection,
    brute_force,
    choose,
    evolve,
    fit_to_budget,
    group_items,
    knapsack,
    scheme_for,
)
from pockengine.sparse import schemes

RATIOS = (0.125, 0.25, 0.5, 1.0)


def _table(rng: random.Random, layers: int, dims: Sequence[str]) -> list[Item]:
    """Per layer a bias item and a weight group whose cost grows with the ratio (values
    need not: some candidates hurt)."""
    items = []
    for layer in range(layers):
        cost = {k: rng.uniform(1, 10) for k in dims}
        items.append(Item(f"bias:{layer}", f"bias:{layer}", rng.uniform(-0.5, 2), cost))
        base = {k: rng.uniform(2, 20) for k in dims}
        for r in RATIOS:
            value = rng.uniform(-0.5, 3) * r**0.5
            items.append(
                Item(
                    f"weight:{layer}@{r}", f"weight:{layer}", value, {k: base[k] * r for k in dims}
                )
            )
    return items


def _check(selection: Selection, room: dict[str, float]) -> None:
    groups = [i.group for i in selection.items]
    assert len(groups) == len(set(groups)), "at most one ratio a layer"
    for k, cap in room.items():
        assert selection.cost(k) <= cap + 1e-9


@pytest.mark.parametrize("dims", [("memory",), ("memory", "flops")])
def test_knapsack_equals_brute_force(dims: tuple[str, ...]) -> None:
    rng = random.Random(len(dims))
    for trial in range(25):
        items = _table(rng, layers=rng.randint(1, 4), dims=dims)
        groups = group_items(items)
        room = {k: rng.uniform(3, 40) for k in dims}
        exact = knapsack(groups, room)
        best = brute_force(groups, room)
        assert exact is not None and exact.exact
        _check(exact, room)
        assert exact.value == pytest.approx(best.value), (trial, exact, best)


def test_knapsack_counts_options_that_cost_nothing() -> None:
    """A candidate whose measured cost fell (clamped to zero) still adds its value."""
    rng = random.Random(11)
    for trial in range(10):
        items = _table(rng, layers=3, dims=("memory",))
        items = [
            Item(i.key, i.group, i.value, {"memory": 0.0}) if rng.random() < 0.3 else i
            for i in items
        ]
        groups = group_items(items)
        room = {"memory": rng.uniform(3, 20)}
        exact = knapsack(groups, room)
        assert exact is not None
        assert exact.value == pytest.approx(brute_force(groups, room).value), trial


def test_evolutionary_search_finds_the_optimum_of_small_problems() -> None:
    rng = random.Random(7)
    gaps = []
    for trial in range(8):
        items = _table(rng, layers=rng.randint(2, 4), dims=("memory", "flops"))
        groups = group_items(items)
        room = {"memory": rng.uniform(5, 40), "flops": rng.uniform(5, 40)}
        found = evolve(groups, room, seed=trial)
        best = brute_force(groups, room)
        _check(found, room)
        assert not found.exact
        assert found.value <= best.value + 1e-9
        gaps.append(best.value - found.value)
    assert max(gaps) <= 1e-9, gaps  # 2-4 layers: exactly the optimum every time


def test_evolutionary_search_near_branch_and_bound_on_a_larger_problem() -> None:
    rng = random.Random(3)
    items = _table(rng, layers=14, dims=("memory",))
    groups = group_items(items)
    room = {"memory": 60.0}
    exact = knapsack(groups, room)
    assert exact is not None
    found = evolve(groups, room, seed=0)
    _check(found, room)
    assert found.value >= 0.95 * exact.value


def test_choose_falls_back_to_evolution_when_branch_and_bound_is_cut_short() -> None:
    items = _table(random.Random(5), layers=10, dims=("memory",))
    budget = Budget({"memory": 130.0, "flops": None}, {"memory": 100.0})
    exact = choose(items, budget)
    cut = choose(items, budget, node_limit=5)
    assert exact.exact and not cut.exact
    _check(cut, budget.room())
    assert cut.value <= exact.value + 1e-9
    with pytest.raises(SchemeError, match="baseline"):
        choose(items, Budget({"memory": 90.0}, {"memory": 100.0}))


def test_negative_contributions_are_never_chosen() -> None:
    items = [Item("a", "a", -1.0, {"memory": 0.0}), Item("b", "b", 0.0, {"memory": 0.0})]
    assert choose(items, Budget({"memory": 10.0})).items == ()


def test_repair_brings_a_non_additive_cost_within_the_budget() -> None:
    """The measured cost adds a shared overhead the items' own costs leave out: the
    estimate fits, the measurement does not, and the repair drops items until it does."""
    items = [Item(f"w{i}", f"w{i}", float(v), {"memory": 10.0}) for i, v in enumerate([5, 4, 1])]
    budget = Budget({"memory": 130.0}, {"memory": 100.0})
    selection = choose(items, budget)
    assert {i.key for i in selection.items} == {"w0", "w1", "w2"}  # 30 <= 30 estimated

    def measure(chosen: Sequence[Item]) -> dict[str, float]:
        return {"memory": 100.0 + sum(12.0 for _ in chosen)}  # 2 MB more each, shared

    chosen, measured = fit_to_budget(selection, items, budget, measure)
    assert measured["memory"] <= 130.0
    assert [i.key for i in chosen] == ["w0", "w1"]  # w2: the least value per byte went


def test_parse_amount() -> None:
    assert parse_amount("300MB") == 300 * 2**20
    assert parse_amount("1.5GiB") == 1.5 * 2**30
    assert parse_amount("12G", flops=True) == 12e9
    assert parse_amount("2.5 GFLOP", flops=True) == 2.5e9
    with pytest.raises(pe.PockEngineError):
        parse_amount("lots")


# -- on a real model, against the compiler's report -----------------------------------


def _peak(work: zoo.Workload, scheme: schemes.Scheme, report: bool = False) -> tuple[int, int]:
    """Planned peak and backward FLOPs as compiled (``analyze(step.graph)`` is what
    ``step.report().ours`` holds; ``report=True`` asks the report itself)."""
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), scheme=scheme,
                      optimizer=pe.optim.AdamW(lr=1e-3))  # fmt: skip
    ours = step.report().ours if report else analyze(step.graph)
    return ours.planned_peak_bytes, ours.backward_flops


def test_memory_budget_holds_in_the_compilers_report(tmp_path: Path) -> None:
    work = zoo.mlp(batch=16, features=64, hidden=128)
    info = torch_model_info(work.model)
    head = sorted(schemes.head().resolve(info).names)
    base_mem, base_flops = _peak(work, scheme_for(head, []))
    rng = random.Random(0)
    items = []
    for layer in ("0", "2"):  # the two hidden Linear layers; "4" is the head
        bias = Item(f"bias:{layer}", f"bias:{layer}", rng.uniform(0.1, 1), {},
                    (f"{layer}.bias",))  # fmt: skip
        items.append(bias)
        for r in (0.25, 1.0):
            w = Item(f"weight:{layer}@{r}", f"weight:{layer}", rng.uniform(0.1, 2) * r**0.5, {},
                     (f"{layer}.weight",), r)  # fmt: skip
            items.append(w)
    # Each candidate's cost measured alone over the head; their sum is only an estimate.
    measured_items = []
    for item in items:
        mem, flops = _peak(work, scheme_for(head, [item]))
        measured_items.append(Item(item.key, item.group, item.value,
                                   {"memory": mem - base_mem, "flops": flops - base_flops},
                                   item.params, item.ratio))  # fmt: skip
    estimated_all = sum(max(i.cost["memory"] for i in measured_items if i.group == g)
                        for g in {i.group for i in measured_items})  # fmt: skip
    limit = base_mem + 0.6 * estimated_all
    budget = Budget({"memory": limit, "flops": None}, {"memory": base_mem, "flops": base_flops})
    selection = choose(measured_items, budget)
    assert selection.exact

    def measure(chosen: Sequence[Item]) -> dict[str, float]:
        mem, flops = _peak(work, scheme_for(head, chosen))
        return {"memory": mem, "flops": flops}

    chosen, measured = fit_to_budget(selection, measured_items, budget, measure)
    assert chosen and measured["memory"] <= limit
    path = tmp_path / "scheme.yaml"
    schemes.save(scheme_for(head, chosen), path)
    loaded = schemes.load(path)
    assert loaded.to_dict() == scheme_for(head, chosen).to_dict()
    mem, _ = _peak(work, loaded, report=True)  # a fresh compile of the file, its report
    assert mem == measured["memory"] and mem <= limit
    step = pe.compile(work.model, work.loss_fn, work.make_batch(0), scheme=loaded)
    trained = {name for name, _ in work.model.named_parameters() if name in step.trained}
    assert trained == {*head, *(p for i in chosen for p in i.params)}
