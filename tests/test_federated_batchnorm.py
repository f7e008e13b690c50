"""BatchNorm statistics and the server's step in federated runs (issue 18): a client
sends the statistics of its shard under its final weights, the server pools them as
those of the pooled data, and FedAvgM's velocity survives a resume. No Flower needed."""

from __future__ import annotations

import dataclasses
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pockengine.federated import FederatedConfig, FederatedError
from pockengine.federated.batchnorm import BatchNormStats
from pockengine.federated.local import LocalTrainer
from pockengine.federated.server_step import ServerStep
from pockengine.finetune import FinetuneConfig
from tests.test_finetune_resume import write_task

# A bag of words with a BatchNorm whose running statistics move slowly (EfficientNet's
# momentum 0.01): after a few local steps they are still mostly their initial values.
BN_MODEL = """
import torch
from torch import nn


class BagBN(nn.Module):
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16, momentum=0.01)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask.unsqueeze(-1).to(torch.float32)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(torch.float32)
        return self.head(torch.relu(self.bn(self.fc(pooled * 4 + 3))))


def bag_bn(vocab_size, num_labels):
    return BagBN(vocab_size, num_labels)
"""
SCHEME = {"scheme": "select", "train": ["fc.*", "bn.*", "head.*"]}


@pytest.fixture
def finetune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FinetuneConfig:
    monkeypatch.syspath_prepend(str(tmp_path))
    options = write_task(tmp_path, rows=240)
    (tmp_path / "fed_bag_bn.py").write_text(BN_MODEL)
    (tmp_path / "scheme.json").write_text(json.dumps(SCHEME))
    for unused in ("epochs", "progress"):
        del options[unused]
    options.update(model="fed_bag_bn:bag_bn", scheme=str(tmp_path / "scheme.json"))
    return FinetuneConfig(recipe=None, out=str(tmp_path / "fed"), **options)


def _shard_statistics(trainer: LocalTrainer) -> tuple[np.ndarray[Any, Any], ...]:
    """The mean over the shard's batches of the batch mean and unbiased variance of the
    BatchNorm's input, under the trainer's current weights (in plain torch)."""
    model = trainer.model
    trainer.step.load_into(model, strict=False)
    means, variances = [], []
    with torch.no_grad():
        for start in range(0, trainer.steps_per_epoch * trainer.batch_size, trainer.batch_size):
            ids, mask = (torch.from_numpy(a[start : start + trainer.batch_size])
                         for a in trainer.shard[:2])  # fmt: skip
            h = trainer.model.emb(ids) * mask.unsqueeze(-1).float()
            pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).float()
            x = trainer.model.fc(pooled * 4 + 3)
            means.append(x.mean(0).numpy())
            variances.append(x.var(0, unbiased=True).numpy())
    return np.mean(means, axis=0), np.mean(variances, axis=0)


def test_a_client_sends_its_shards_statistics_not_the_lagging_running_ones(
    finetune: FinetuneConfig,
) -> None:
    """After a round, "recompute" sends the statistics of the shard under the final
    weights; "running" sends the step's running statistics, which after a few steps at
    momentum 0.01 are still near their initial (0, 1). Params are the same either way."""
    config = FederatedConfig(finetune=finetune, clients=2, rounds=1)
    recompute = LocalTrainer(config, client=1)
    start = recompute.trained.extract(recompute.step)
    sent = recompute.train(start, server_round=1, mu=0.0).arrays
    mean, var = _shard_statistics(recompute)
    np.testing.assert_allclose(sent["bn.running_mean"], mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sent["bn.running_var"], var, rtol=1e-4, atol=1e-5)
    assert np.abs(mean).max() > 0.5  # far from the initial zeros: the test can tell

    running = LocalTrainer(dataclasses.replace(config, bn_statistics="running"), client=1)
    lagging = running.train(start, server_round=1, mu=0.0).arrays
    assert np.abs(lagging["bn.running_mean"] - mean).max() > 0.5 * np.abs(mean).max()
    own = running.step.flat_state_dict(["bn.running_mean"])["bn.running_mean"]
    np.testing.assert_array_equal(lagging["bn.running_mean"], own)
    for name in ("fc.weight", "bn.weight", "head.weight"):
        np.testing.assert_array_equal(sent[name], lagging[name], err_msg=name)


def test_pooled_statistics_are_those_of_the_pooled_data() -> None:
    """Two clients with different means (label skew): the pooled variance counts the
    spread of their means, as np.var of the concatenated data does."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(-2.0, 1.0, (30, 3)), rng.normal(3.0, 0.5, (90, 3))
    replies = [{"l.running_mean": x.mean(0), "l.running_var": x.var(0)} for x in (a, b)]
    weights = [30.0, 90.0]
    average = {k: (30 * replies[0][k] + 90 * replies[1][k]) / 120 for k in replies[0]}
    pooled = BatchNormStats({"l.running_var": "l.running_mean"}).pool(average, replies, weights)
    both = np.concatenate([a, b])
    np.testing.assert_allclose(pooled["l.running_mean"], both.mean(0), rtol=1e-12)
    np.testing.assert_allclose(pooled["l.running_var"], both.var(0), rtol=1e-12)
    assert (average["l.running_var"] < 0.5 * both.var(0)).all()  # the plain mean is far off


def test_batchnorm_layers_are_found_by_type_and_left_as_they_were() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4))  # fmt: skip
    sent = ["1.running_mean", "1.running_var", "3.running_mean"]  # 3's variance stays home
    assert BatchNormStats.of(model, sent).pairs == {"1.running_var": "1.running_mean"}


def test_server_step_is_fedavg_by_default_and_fedavgm_with_momentum() -> None:
    stats = frozenset({"bn.running_mean"})
    g0 = {"w": np.array([1.0, 2.0], np.float32), "bn.running_mean": np.zeros(2, np.float32)}
    avg1 = {"w": np.array([2.0, 2.0], np.float32), "bn.running_mean": np.ones(2, np.float32)}
    assert ServerStep(stats).apply(g0, avg1) is avg1  # FedAvg: the average, bit for bit
    step = ServerStep(stats, lr=2.0, momentum=0.5)
    g1 = step.apply(g0, avg1)
    np.testing.assert_allclose(g1["w"], g0["w"] + 2.0 * (avg1["w"] - g0["w"]))
    np.testing.assert_array_equal(g1["bn.running_mean"], avg1["bn.running_mean"])
    avg2 = {"w": g1["w"] - 1.0, "bn.running_mean": np.full(2, 5.0, np.float32)}
    g2 = step.apply(g1, avg2)
    velocity = 0.5 * (avg1["w"] - g0["w"]) + (avg2["w"] - g1["w"])
    np.testing.assert_allclose(g2["w"], g1["w"] + 2.0 * velocity, rtol=1e-6)
    assert g2["w"].dtype == np.float32 and "bn.running_mean" not in step.velocity


def test_server_options_are_checked() -> None:
    with pytest.raises(FederatedError, match="server_momentum must be in"):
        FederatedConfig(server_momentum=1.0).validate()
    with pytest.raises(FederatedError, match="server_lr must be > 0"):
        FederatedConfig(server_lr=0.0).validate()
    with pytest.raises(FederatedError, match="bn_statistics must be recompute or running"):
        FederatedConfig(bn_statistics="local").validate()


@pytest.mark.skipif(find_spec("flwr") is None, reason="Flower is not installed")
def test_the_server_velocity_is_saved_with_the_global_state_and_resumed(
    finetune: FinetuneConfig,
) -> None:
    """FedAvgM's velocity travels in global.safetensors (beside, not among, the trained
    tensors), so a resumed server continues with it."""
    from pockengine.federated.local import prepare
    from pockengine.federated.payload import TrainedSet
    from pockengine.federated.server import _RoundLog, _start_state

    config = FederatedConfig(finetune=finetune, clients=2, rounds=3, server_momentum=0.9)
    config, task, step = prepare(config)
    trained = TrainedSet.of(step)
    out = Path(str(finetune.out))
    out.mkdir()
    arrays = trained.extract(step)
    velocity = {"fc.weight": np.full((16, 16), 0.25), "head.bias": np.arange(2.0)}
    saved = ServerStep(trained.buffers, 1.0, 0.9)
    saved.velocity = velocity
    _RoundLog(config, task, step, trained, out, 0.0)._save(2, arrays, saved.state())
    server = ServerStep(trained.buffers, 1.0, 0.9)
    resumed = dataclasses.replace(config, resume=True)
    done, loaded = _start_state(resumed, out, trained, step, server)
    assert done == 2 and set(loaded) == set(arrays) == set(trained.rows)
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)
    assert set(server.velocity) == set(velocity)
    for name, array in velocity.items():
        np.testing.assert_array_equal(server.velocity[name], array, err_msg=name)


# A frozen BatchNorm (``bn0``, far-off running statistics) ahead of the trained one: a
# scheme with frozen_bn="eval" runs it on those running statistics in every step.
FROZEN_BN_MODEL = BN_MODEL.replace(
    "        self.fc = nn.Linear(16, 16)\n",
    "        self.bn0 = nn.BatchNorm1d(16)\n"
    "        with torch.no_grad():\n"
    "            self.bn0.running_mean.fill_(2.0)\n"
    "            self.bn0.running_var.fill_(9.0)\n"
    "        self.fc = nn.Linear(16, 16)\n",
).replace("self.fc(pooled * 4 + 3)", "self.fc(self.bn0(pooled * 4 + 3))")


def test_recomputed_statistics_keep_the_frozen_layers_on_their_running_ones(
    finetune: FinetuneConfig, tmp_path: Path
) -> None:
    """The statistics pass runs the model as the step does: a BatchNorm the scheme
    freezes on its running statistics normalises by those, not by the batch, so the
    trained BatchNorm after it sees the inputs it saw in training."""
    (tmp_path / "fed_bag_frozen_bn.py").write_text(FROZEN_BN_MODEL)  # a module of its own
    (tmp_path / "scheme.json").write_text(json.dumps({**SCHEME, "frozen_bn": "eval"}))
    frozen = dataclasses.replace(finetune, model="fed_bag_frozen_bn:bag_bn")
    config = FederatedConfig(finetune=frozen, clients=2, rounds=1)
    trainer = LocalTrainer(config, client=1)
    assert set(trainer.batchnorm.pairs) == {"bn.running_var"}  # bn0's are not sent
    sent = trainer.train(trainer.trained.extract(trainer.step), server_round=1, mu=0.0).arrays
    model = trainer.model
    trainer.step.load_into(model, strict=False)
    model.bn0.eval()
    means, variances = [], []
    with torch.no_grad():
        for start in range(0, trainer.steps_per_epoch * trainer.batch_size, trainer.batch_size):
            ids, mask = (torch.from_numpy(a[start : start + trainer.batch_size])
                         for a in trainer.shard[:2])  # fmt: skip
            h = model.emb(ids) * mask.unsqueeze(-1).float()
            pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).float()
            x = model.fc(model.bn0(pooled * 4 + 3))
            means.append(x.mean(0).numpy())
            variances.append(x.var(0, unbiased=True).numpy())
    np.testing.assert_allclose(sent["bn.running_mean"], np.mean(means, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sent["bn.running_var"], np.mean(variances, 0), rtol=1e-4, atol=1e-5)
    assert model.bn0.running_mean.eq(2.0).all()  # the frozen layer's own are untouched
