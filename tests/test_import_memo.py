"""``frontend.import_memo.reused_imports``: inside it, ``import_torch`` exports a model once
per parameter state, batch and mode (the compile child reuses the analysis' import of the
run's batch); outside it every call exports; a reused import compiles the same step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine.frontend.import_memo import reused_imports
from pockengine.frontend.torch import importer as frontend


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = frontend._export

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(frontend, "_export", counted)
    return calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))  # fmt: skip


def test_an_import_is_made_once_per_state_batch_and_mode(exports: list[int]) -> None:
    model = _model()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    with reused_imports() as memo:
        first = frontend.import_torch(model, _loss, (x, y))
        again = frontend.import_torch(model, _loss, (x.clone(), y.clone()))  # equal values
        assert again is first and len(exports) == 1 and memo.reused == 1
        # another batch, another mode, another BatchNorm mode, a replaced weight: exported
        frontend.import_torch(model, _loss, (x + 1, y))
        frontend.import_torch(model, _loss, (x[:2], y[:2]))
        frontend.import_torch(model, _loss, (x, y), eval_modules=["1"])
        model.eval()
        frontend.import_torch(model, _loss, (x, y))
        model.train()
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        frontend.import_torch(model, _loss, (x, y))
        assert len(exports) == 6 and memo.reused == 1
        memo.keep(4)  # the 2-example import is forgotten, the others kept
        assert {k.rows for k in memo.imports} == {4} and len(memo.imports) == 5
    assert not memo.imports
    frontend.import_torch(model, _loss, (x, y))  # outside: no memo
    frontend.import_torch(model, _loss, (x, y))
    assert len(exports) == 8


def test_a_reused_import_compiles_the_same_step(exports: list[int]) -> None:
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    losses = []
    for reuse in (False, True):
        model = _model()
        with reused_imports():
            if reuse:
                frontend.import_torch(model, _loss, (x, y))
            step = pe.compile(model, _loss, (x, y), scheme=pe.schemes.bias_only(), backend="numpy")
        losses.append([float(step(x, y)) for _ in range(3)])
    assert len(exports) == 2  # the reusing run's compile made no export of its own
    np.testing.assert_array_equal(losses[0], losses[1])
