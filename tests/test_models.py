"""Whole models: loss and every gradient match torch.autograd; updates match torch.optim."""

from __future__ import annotations

import pytest
import torch

import pockengine as pe
from pockengine import zoo
from tests.torch_ref import assert_gradients_match, assert_training_matches


def test_mlp_gradients() -> None:
    assert_gradients_match(zoo.mlp())


def test_small_cnn_gradients() -> None:
    assert_gradients_match(zoo.small_cnn())


def test_mobilenet_v2_gradients() -> None:
    # In float32 this randomly initialised network is ill-conditioned: torch's own float32
    # gradients differ from its float64 ones by more than the tolerance (ReLU6 kinks flip
    # with rounding), so the exact comparison runs in float64.
    assert_gradients_match(
        zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64)), rtol=1e-7, atol=1e-10
    )


def test_bert_gradients() -> None:
    assert_gradients_match(zoo.bert_classifier())


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gradients(tied: bool) -> None:
    assert_gradients_match(zoo.llama_lm(tied=tied))


def test_sgd_momentum_matches_torch() -> None:
    assert_training_matches(
        zoo.small_cnn(),
        pe.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    )


def test_adamw_matches_torch() -> None:
    assert_training_matches(
        zoo.bert_classifier(),
        pe.optim.AdamW(lr=1e-3, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    )


def test_plain_sgd_matches_torch() -> None:
    assert_training_matches(
        zoo.mlp(), pe.optim.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), steps=4
    )
