"""The clients' logit-adjusted local loss against label skew (issue 18): its value and
gradient against torch, bit-identity with the plain loss at tau 0, each client's own
prior (compiled alone or sharing a step), and the option from the command line to the
ClientApp. The tiny bag-of-words task of ``test_federated``; no Flower process starts."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine.federated import FederatedConfig, FederatedError
from pockengine.federated.cli import add_arguments, config_from_args
from pockengine.federated.local import LocalTrainer, compile_task, prepare
from pockengine.federated.local_loss import (
    PSEUDO_COUNT,
    adjusted_batch,
    label_prior,
    logit_adjusted_loss,
    logit_bias,
)
from pockengine.federated.partition import partition
from pockengine.finetune import FinetuneConfig
from pockengine.optim import SGD
from pockengine.tasks import recipes
from tests.test_federated import SENT_SHAPES
from tests.test_federated import finetune as finetune  # the tiny task's fixture

Array = np.ndarray[Any, Any]


def _adjusted(ft: FinetuneConfig, tau: float, **options: Any) -> FederatedConfig:
    return FederatedConfig(finetune=ft, local_loss="logit-adjusted", la_tau=tau, **options)


# -- the loss -------------------------------------------------------------------------


def test_adjusted_loss_matches_torch_in_value_and_gradient() -> None:
    """One compiled SGD step on ``logits + tau * log p``: the loss it returns and the
    weights it leaves are torch's, and differ from the plain loss's (the bias matters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = np.array([0, 0, 0, 1, 1, 2, 0, 1])  # classes 3 and 4 absent
    bias = logit_bias(y, 5, tau=1.5)
    batch = adjusted_batch((x, y), bias)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    example = tuple(torch.from_numpy(a) for a in batch)
    step = pe.compile(model, logit_adjusted_loss, example, optimizer=SGD(lr=0.1))
    loss = step(*batch)

    reference = copy.deepcopy(model)
    reference.load_state_dict(initial)
    logits = reference(torch.from_numpy(x))
    want = F.cross_entropy(logits + torch.from_numpy(bias), torch.from_numpy(y))
    want.backward()  # type: ignore[no-untyped-call]
    np.testing.assert_allclose(loss, want.item(), rtol=1e-6)
    plain = F.cross_entropy(logits.detach(), torch.from_numpy(y)).item()
    assert abs(plain - want.item()) > 1e-2
    got = step.flat_state_dict()
    for name, param in reference.named_parameters():
        assert param.grad is not None
        expected = (initial[name] - 0.1 * param.grad).numpy()
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_prior_is_smoothed_so_absent_classes_stay_finite() -> None:
    labels = np.array([0, 0, 0, 2])
    prior = label_prior(labels, 4)
    np.testing.assert_allclose(
        prior, (np.array([3, 0, 1, 0]) + PSEUDO_COUNT) / (4 + 4 * PSEUDO_COUNT)
    )
    assert np.isfinite(logit_bias(labels, 4, 2.0)).all()
    np.testing.assert_array_equal(logit_bias(labels, 4, 0.0), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        label_prior(np.array([0, 4]), 4)


# -- the local trainer -----------------------------------------------------------------


def test_tau_zero_trains_bit_for_bit_as_the_plain_loss(finetune: FinetuneConfig) -> None:
    """The adjusted step with a zero bias: the same losses and trained tensors as the
    task's own loss over a round of local steps (dropout included)."""
    plain = LocalTrainer(FederatedConfig(finetune=finetune, clients=2, rounds=2), client=1)
    zero = LocalTrainer(_adjusted(finetune, 0.0, clients=2, rounds=2), client=1)
    assert plain.logit_bias is None and zero.logit_bias is not None
    start = plain.trained.extract(plain.step)
    a, b = plain.train(start, server_round=1, mu=0.0), zero.train(start, 1, mu=0.0)
    assert a.loss == b.loss
    assert a.arrays.keys() == b.arrays.keys()
    for name in a.arrays:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name], err_msg=name)
    assert not np.array_equal(a.arrays["head.weight"], start["head.weight"])


def test_each_client_trains_on_its_own_shards_prior(finetune: FinetuneConfig) -> None:
    """Clients compiled separately each hold their shard's prior; a trainer given
    another shard (the in-process driver's reuse of one step) takes that shard's; a
    positive tau moves the weights off the plain loss's."""
    config = _adjusted(finetune, 1.0, clients=2, rounds=1, partition="dirichlet", alpha=0.3)
    trainers = [LocalTrainer(config, client=c) for c in (0, 1)]
    ft = trainers[0].config.finetune
    task = recipes.build(ft)
    shards = partition(task.train, "dirichlet", 2, 0.3, ft.seed, trainers[0].batch_size)
    for c, trainer in enumerate(trainers):
        labels = task.train[-1][shards[c]]
        np.testing.assert_array_equal(trainer.shard[-1], labels)
        assert trainer.logit_bias is not None
        np.testing.assert_allclose(trainer.logit_bias, np.log(label_prior(labels, 2)), rtol=1e-6)
    first, second = (t.logit_bias for t in trainers)
    assert first is not None and second is not None and not np.allclose(first, second)
    shared = copy.copy(trainers[0])
    shared.use_shard(1, trainers[1].shard)
    assert shared.step is trainers[0].step and shared.steps_per_round == trainers[1].steps_per_round
    np.testing.assert_array_equal(shared.logit_bias, trainers[1].logit_bias)

    plain = LocalTrainer(FederatedConfig(**{**vars(config), "local_loss": "plain"}), client=1)
    start = plain.trained.extract(plain.step)
    adjusted = trainers[1].train(start, 1, mu=0.0).arrays["head.bias"]
    assert not np.allclose(adjusted, plain.train(start, 1, mu=0.0).arrays["head.bias"])


def test_the_adjusted_step_sends_what_the_plain_step_sends(finetune: FinetuneConfig) -> None:
    """The loss changes nothing in the message: the same trained names and shapes (so
    the server, whichever loss it compiled, accepts every reply)."""
    _, _, step = prepare(_adjusted(finetune, 1.0))
    trainer = LocalTrainer(_adjusted(finetune, 1.0), client=0)
    shapes = {k: list(v) for k, v in trainer.trained.shapes.items()}
    assert shapes == SENT_SHAPES
    sent = trainer.train(trainer.trained.extract(step), 1, mu=0.0).arrays
    assert {k: list(v.shape) for k, v in sent.items()} == SENT_SHAPES


def test_the_clientapp_trains_its_partition_on_its_prior(finetune: FinetuneConfig) -> None:
    """The option reaches a ClientApp through the run config (JSON): the process's
    trainer has its partition's prior, and its reply holds the trained tensors."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from pockengine.federated import client

    config = _adjusted(finetune, 2.0, clients=2, rounds=1, partition="dirichlet", alpha=0.3)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 8, 1
    node: dict[str, bool | float | int | str] = {"partition-id": 1, "num-partitions": 2}
    context = Context(8, 1002, node, RecordDict(), {client.RUN_CONFIG_KEY: config.to_json()})
    arrays = {k: np.zeros(v, np.float32) for k, v in SENT_SHAPES.items()}
    content = RecordDict({"arrays": client.to_record(arrays),
                          "config": ConfigRecord({"server-round": 1})})  # fmt: skip
    message = Message(content, 1002, MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = "la1"
    reply = client.app(message, context)
    got = client.to_arrays(reply.content.array_records["arrays"])
    assert {k: list(v.shape) for k, v in got.items()} == SENT_SHAPES
    trainer = client.trainer_for(context)
    assert trainer.client == 1 and trainer.config.local_loss == "logit-adjusted"
    assert trainer.logit_bias is not None
    prior = label_prior(trainer.shard[-1], 2)
    np.testing.assert_allclose(trainer.logit_bias, 2.0 * np.log(prior), rtol=1e-6)


def test_a_task_without_logits_is_refused(finetune: FinetuneConfig) -> None:
    config, task, _ = prepare(FederatedConfig(finetune=finetune))
    lm = recipes.Task("lm", task.model, task.loss_fn, task.train, task.val, (), "causal-lm")
    ft, scheme = config.finetune, recipes.parse_scheme(str(config.finetune.scheme), None)
    with pytest.raises(FederatedError, match=r"needs a classification task.*causal-lm"):
        compile_task(ft, lm, scheme, "logit-adjusted")


# -- the option ------------------------------------------------------------------------


def test_the_option_round_trips_through_the_command_line_and_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--local-loss", "logit-adjusted", "--la-tau", "0.5"])
    config = config_from_args(args).validate()
    assert (config.local_loss, config.la_tau) == ("logit-adjusted", 0.5)
    assert FederatedConfig.from_json(config.to_json()) == config
    default = config_from_args(parser.parse_args([]))
    assert (default.local_loss, default.la_tau) == ("plain", 1.0)
    # a run saved before the option existed trained plain: it resumes only as plain
    saved = json.loads(json.dumps(default.training_dict()))
    del saved["local_loss"], saved["la_tau"]
    assert default.trains_as_saved(saved) and not config.trains_as_saved(saved)
    with pytest.raises(SystemExit):
        parser.parse_args(["--local-loss", "balanced"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"local_loss": "fedrs"}, "local_loss must be one of plain, logit-adjusted"),
        ({"la_tau": -1.0}, "la_tau .* must be a finite number >= 0, got -1.0"),
        ({"la_tau": float("nan")}, "la_tau .* got nan"),
    ],
)
def test_bad_values_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(FederatedError, match=message):
        FederatedConfig(**options).validate()
