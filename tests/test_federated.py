"""Federated sparse fine-tuning on Flower (issue 18): a tiny bag-of-words model with a
partial-channel layer on a small CSV, so that a simulation with client processes runs
in CI. Tests that run Flower skip when it is not installed (pip install
'pockengine[federated]'); the data partitions and the local trainer need no Flower."""

from __future__ import annotations

import dataclasses
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pockengine.federated import FederatedConfig, FederatedError
from pockengine.federated.local import LocalTrainer
from pockengine.federated.partition import dirichlet, iid, partition
from pockengine.finetune import FinetuneConfig
from tests.test_finetune_resume import write_task

needs_flwr = pytest.mark.skipif(
    find_spec("flwr") is None, reason="Flower is not installed: pip install 'pockengine[federated]'"
)

FED_MODEL = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask.unsqueeze(-1).to(torch.float32)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(torch.float32)
        return self.head(self.drop(torch.relu(self.fc(pooled))))


def bag(vocab_size, num_labels):
    return Bag(vocab_size, num_labels)
"""
# fc trains its first 8 of 16 output rows; the embedding stays frozen and never travels
SCHEME = {"scheme": "select", "train": ["fc.*", "head.*"], "channels": {"fc.weight": 0.5}}
SENT_SHAPES = {"fc.weight": [8, 16], "fc.bias": [16], "head.weight": [2, 16], "head.bias": [2]}
SENT_BYTES = 4 * (8 * 16 + 16 + 2 * 16 + 2)  # float32


@pytest.fixture
def finetune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FinetuneConfig:
    """The finetune options of the tiny task (its module importable by client processes)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    options = write_task(tmp_path, rows=240)
    (tmp_path / "fed_bag.py").write_text(FED_MODEL)
    (tmp_path / "scheme.json").write_text(json.dumps(SCHEME))
    for unused in ("epochs", "progress"):
        del options[unused]
    options.update(model="fed_bag:bag", scheme=str(tmp_path / "scheme.json"))
    return FinetuneConfig(recipe=None, out=str(tmp_path / "fed"), **options)


def federated(ft: FinetuneConfig, **options: Any) -> FederatedConfig:
    return FederatedConfig(finetune=ft, **options)


def rounds_log(ft: FinetuneConfig) -> list[dict[str, Any]]:
    assert ft.out is not None
    lines = (Path(ft.out) / "rounds.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# -- partitions and options (no Flower) --------------------------------------------------


def test_iid_shards_cover_the_split_once_and_one_client_keeps_its_order() -> None:
    shards = iid(103, 4, seed=0)
    assert sorted(len(s) for s in shards) == [25, 26, 26, 26]
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(103))
    np.testing.assert_array_equal(iid(50, 1, seed=3)[0], np.arange(50))


def test_dirichlet_skews_labels_and_is_reproducible() -> None:
    labels = np.repeat(np.arange(5), 200)
    shards = dirichlet(labels, 10, alpha=0.5, seed=1, least=16)
    again = dirichlet(labels, 10, alpha=0.5, seed=1, least=16)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(1000))
    assert min(len(s) for s in shards) >= 16
    # label skew: the commonest label holds far more than a fifth of a typical shard
    top = [np.bincount(labels[s], minlength=5).max() / len(s) for s in shards]
    assert np.median(top) > 0.4, top
    iid_top = [np.bincount(labels[s], minlength=5).max() / len(s) for s in iid(1000, 10, 1)]
    assert np.median(iid_top) < 0.3, iid_top


def test_partition_errors_name_the_problem() -> None:
    train = (np.zeros((20, 4)), np.arange(20) % 2)
    with pytest.raises(FederatedError, match=r"20 training examples make 2 batch\(es\) of 8"):
        partition(train, "iid", 4, 0.5, 0, least=8)
    with pytest.raises(FederatedError, match="needs class labels"):
        partition((np.zeros((20, 4)),), "dirichlet", 2, 0.5, 0, least=2)
    with pytest.raises(FederatedError, match="in 100 draws"):
        dirichlet(np.arange(20) % 2, 4, alpha=0.01, seed=0, least=5)


def test_options_are_checked() -> None:
    with pytest.raises(FederatedError, match="clients must be a positive integer"):
        FederatedConfig(clients=0).validate()
    with pytest.raises(FederatedError, match="partition must be iid or dirichlet"):
        FederatedConfig(partition="shards").validate()
    with pytest.raises(FederatedError, match="expected CLIENT:ROUND"):
        FederatedConfig(fail=("1",)).validate()
    config = FederatedConfig(fail=("1:2",), delay=("0:1:2.5",)).validate()
    assert config.fails(1, 2) and not config.fails(1, 1) and config.delay_s(0, 1) == 2.5
    assert FederatedConfig.from_json(config.to_json()) == config


# -- the local trainer (no Flower) -----------------------------------------------------


def test_fedprox_pull_of_one_returns_the_global_tensors(finetune: FinetuneConfig) -> None:
    """A client with one step a round and lr * mu = 1: the proximal step lands back on
    the global tensors; without it the step moves them. Frozen rows never move."""
    ft = FinetuneConfig(**{**vars(finetune), "warmup": 0.0, "max_train": 16})
    trainer = LocalTrainer(federated(ft, clients=2, rounds=1), client=1)
    assert trainer.steps_per_round == 1
    start = trainer.trained.extract(trainer.step)
    frozen_rows = trainer.step.flat_state_dict()["fc.weight"][8:].copy()
    free = trainer.train(start, server_round=1, mu=0.0).arrays
    assert all(not np.array_equal(free[k], start[k]) for k in start)
    pulled = trainer.train(start, server_round=1, mu=1 / float(ft.lr or 1)).arrays
    for name, array in pulled.items():
        np.testing.assert_allclose(array, start[name], rtol=0, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(trainer.step.flat_state_dict()["fc.weight"][8:], frozen_rows)


# -- Flower: messages, the equivalence with central training, a whole simulation --------


@needs_flwr
def test_messages_carry_exactly_the_trained_tensors(finetune: FinetuneConfig) -> None:
    """The ClientApp, called as a SuperNode calls it: the reply holds the trained
    tensors (fc.weight as its 8 trained rows, no embedding), its byte count is what
    its metrics report, and a second round reuses the compiled step."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from pockengine.federated import client
    from pockengine.federated.local import prepare
    from pockengine.federated.payload import TrainedSet
    from pockengine.federated.strategy import SparseFedAvg

    config = federated(finetune, clients=2, rounds=2)
    trained = TrainedSet.of(prepare(config)[2])
    assert {k: list(v) for k, v in trained.shapes.items()} == SENT_SHAPES
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
    node_config: dict[str, bool | float | int | str] = {"partition-id": 1, "num-partitions": 2}
    context = Context(7, 1002, node_config, RecordDict(), {client.RUN_CONFIG_KEY: config.to_json()})
    arrays = {k: np.zeros(v, np.float32) for k, v in trained.shapes.items()}
    replies = []
    for server_round in (1, 2):
        content = RecordDict({
            "arrays": client.to_record(arrays),
            "config": ConfigRecord({"server-round": server_round}),
        })  # fmt: skip
        message = Message(content, 1002, MessageType.TRAIN)
        message.metadata.__dict__["_message_id"] = f"m{server_round}"
        replies.append(client.app(message, context))
        if server_round == 1:
            compiled = next(iter(client._TRAINERS.values())).step
    assert next(iter(client._TRAINERS.values())).step is compiled  # not recompiled
    for reply in replies:
        got = client.to_arrays(reply.content.array_records["arrays"])
        assert {k: list(v.shape) for k, v in got.items()} == SENT_SHAPES
        metrics = reply.content.metric_records["metrics"]
        assert metrics["bytes-up"] == SENT_BYTES == sum(a.nbytes for a in got.values())
        assert metrics["num-examples"] == 96 // 8 * 8 and metrics["client"] == 1
    strategy = SparseFedAvg(trained, clients=2)
    assert strategy._reject(replies[0]) is None
    leaky = client.to_arrays(replies[0].content.array_records["arrays"])
    leaky["emb.weight"] = np.zeros((3, 16), np.float32)
    content = RecordDict({
        "arrays": client.to_record(leaky),
        "metrics": replies[0].content.metric_records["metrics"],
    })  # fmt: skip
    reason = strategy._reject(Message(content, reply_to=message))
    assert reason is not None and "unexpected ['emb.weight']" in reason


def test_upload_budget_limits_what_auto_trains(finetune: FinetuneConfig) -> None:
    """--scheme auto chosen once (on client 0's shard) within the memory budget and, with
    --upload-budget, a fraction of full-model FedAvg's bytes: the model holds 3,810 floats,
    so 5% (190) fits the base (fc.bias, head: 50) and half of fc.weight's 16 rows (128)."""
    from pockengine.federated.local import resolve_scheme
    from pockengine.tasks.config import FinetuneError

    ft = dataclasses.replace(finetune, scheme="auto", memory_budget=float(64 << 20))
    chosen = {}
    for budget in (None, 0.5, 0.05):
        config = resolve_scheme(federated(ft, clients=2, upload_budget=budget))
        assert config.scheme_choice is not None
        chosen[budget] = config.scheme_choice
        assert resolve_scheme(config) is config  # chosen once: clients do not choose again
    assert chosen[None]["scheme"] == "full"  # the memory budget allows it, nothing else limits
    assert sorted(chosen[0.5]["train"]) == ["fc.bias", "fc.weight", "head.bias", "head.weight"]
    assert "channels" not in chosen[0.5]
    assert chosen[0.05]["channels"] == {"fc.weight": 0.5}
    trainer = LocalTrainer(federated(ft, clients=2, upload_budget=0.05), 1)
    assert {k: list(v) for k, v in trainer.trained.shapes.items()} == SENT_SHAPES
    with pytest.raises(FinetuneError, match=r"upload budget .* below what the bias scheme"):
        resolve_scheme(federated(ft, clients=2, upload_budget=0.01))
    with pytest.raises(FederatedError, match="--upload-budget limits what --scheme auto"):
        resolve_scheme(federated(finetune, upload_budget=0.5))
    with pytest.raises(FederatedError, match="upload_budget is a fraction"):
        federated(ft, upload_budget=2.0).validate()


def test_auto_analyses_client_0s_shard_or_the_pooled_split(
    finetune: FinetuneConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The analysis sees client 0's shard; ``pooled=True`` (the benchmark's diagnosis)
    the whole training split."""
    from pockengine.federated import local
    from pockengine.scheme_choice import auto_scheme
    from pockengine.tasks import recipes

    seen: list[int] = []
    real = auto_scheme.choose_auto

    def spy(config: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(task.train[0]))
        return real(config, task, *args, **kwargs)

    monkeypatch.setattr(auto_scheme, "choose_auto", spy)
    ft = dataclasses.replace(finetune, scheme="auto", memory_budget=float(64 << 20))
    config = federated(ft, clients=2)
    whole = len(recipes.build(local.with_defaults(config).finetune).train[0])
    local.resolve_scheme(config)
    local.resolve_scheme(config, pooled=True)
    assert seen[1] == whole and 0 < seen[0] < whole


@needs_flwr
def test_one_client_one_round_is_the_central_run(finetune: FinetuneConfig) -> None:
    """One client, one round, IID: the global state equals, bit for bit, the weights of
    `pockengine finetune` over the same epochs (same seed, order, schedule, dropout)."""
    import pockengine as pe
    from pockengine.federated.engine import simulate

    summary = simulate(federated(finetune, clients=1, rounds=1, local_epochs=2))
    assert summary["rounds"] == 1
    central = pe.finetune(finetune, epochs=2, progress="none", out=f"{finetune.out}-central")
    assert central.step is not None
    weights = central.step.flat_state_dict()
    saved = _global_state(finetune)
    assert set(saved) == set(SENT_SHAPES)
    for name, array in saved.items():
        np.testing.assert_array_equal(array, weights[name][: array.shape[0]], err_msg=name)
    assert not np.array_equal(saved["head.weight"], _initial(finetune)["head.weight"])


def _global_state(ft: FinetuneConfig) -> dict[str, Any]:
    from safetensors.numpy import load_file

    return load_file(str(Path(str(ft.out)) / "global.safetensors"))


def _initial(ft: FinetuneConfig) -> dict[str, Any]:
    from pockengine.federated.local import prepare

    return prepare(federated(ft))[2].flat_state_dict()


@needs_flwr
def test_three_clients_two_rounds_drop_a_failing_client_and_resume(
    finetune: FinetuneConfig, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`pockengine federated --scheme auto --upload-budget 0.05`: the scheme chosen once
    (fc.weight's first 8 rows fit 5% of the model's floats, SENT_SHAPES), 3 client
    processes, Dirichlet shards, client 1 failing in round 2; the server stops after round
    1 and a second command resumes it with the choice it saved."""
    from pockengine.cli import main

    args = [
        "federated", "--model", str(finetune.model), "--data", str(finetune.data),
        "--text-column", "review", "--label-column", "sentiment", "--seq-len", "12",
        "--batch-size", "8", "--lr", "0.01", "--scheme", "auto", "--upload-budget", "0.05",
        "--memory-budget", "64MB",
        "--clients", "3", "--rounds", "2", "--partition", "dirichlet", "--alpha", "1.0",
        "--fail", "1:2", "--out", str(finetune.out),
    ]  # fmt: skip
    caplog.set_level("INFO", logger="pockengine.federated.local")
    assert main([*args, "--stop-after-round", "1"]) == 0
    assert [r["round"] for r in rounds_log(finetune)] == [1]
    analysed = [r.message for r in caplog.records if r.message.startswith("auto scheme:")]
    assert analysed and "bias + 1 of 1 weights" in analysed[0]
    caplog.clear()
    chose = "--scheme auto chose, on client 0's shard: 4 trained tensor patterns, 1 of them"
    assert chose in capsys.readouterr().out
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "2 round(s) of 3 client(s)" in out and "sent up" in out and chose in out
    assert not [r for r in caplog.records if r.message.startswith("auto scheme:")]  # as saved
    rows = rounds_log(finetune)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["clients"] == [0, 1, 2] and rows[0]["dropped"] == []
    assert rows[1]["clients"] == [0, 2]
    assert len(rows[1]["dropped"]) == 1 and "client 1 fails in round 2" in rows[1]["dropped"][0]
    full = rows[0]["bytes_full_model"] / 3
    assert full > 10 * SENT_BYTES  # the frozen embedding stays home
    for row in rows:
        assert row["bytes_up"] == SENT_BYTES * len(row["clients"])
        assert row["bytes_down"] == SENT_BYTES * 3
        assert row["bytes_full_model"] == full * len(row["clients"])
        assert 0.0 <= row["accuracy"] <= 1.0 and np.isfinite(row["loss"])
    summary = json.loads((Path(str(finetune.out)) / "summary.json").read_text())
    assert summary["resumed_at"] == 1 and summary["rounds"] == 2
    assert summary["config"]["scheme_choice"]["channels"] == {"fc.weight": 0.5}
    assert summary["up_ratio"] == pytest.approx(SENT_BYTES / full)
    if find_spec("matplotlib") is not None:
        assert (Path(str(finetune.out)) / "rounds.png").stat().st_size > 0


@needs_flwr
def test_saved_state_is_not_overwritten_and_resume_checks_the_options(
    finetune: FinetuneConfig,
) -> None:
    from safetensors.numpy import save_file

    from pockengine.federated.server import GLOBAL_STATE, run_server

    out = Path(str(finetune.out))
    out.mkdir()
    with pytest.raises(FederatedError, match="no saved global state"):
        run_server(None, federated(finetune, resume=True))  # type: ignore[arg-type]
    meta = {"round": "1", "config": json.dumps(federated(finetune, rounds=5).training_dict())}
    save_file({"head.bias": np.zeros(2, np.float32)}, str(out / GLOBAL_STATE), metadata=meta)
    with pytest.raises(FederatedError, match="continue it with --resume"):
        run_server(None, federated(finetune))  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="saved by a run with other options"):
        run_server(None, federated(finetune, rounds=3, resume=True))  # type: ignore[arg-type]
    whole = (out / GLOBAL_STATE).read_bytes()
    damaged = {"truncated": whole[:20], "no round": None, "not safetensors": b"PK\x03\x04zip"}
    for what, data in damaged.items():
        if data is None:  # a safetensors file without the run's metadata
            save_file({"head.bias": np.zeros(2, np.float32)}, str(out / GLOBAL_STATE))
        else:
            (out / GLOBAL_STATE).write_bytes(data)
        before = (out / GLOBAL_STATE).read_bytes()
        with pytest.raises(FederatedError, match="is not a saved global state"):
            run_server(None, federated(finetune, rounds=5, resume=True))  # type: ignore[arg-type]
        assert (out / GLOBAL_STATE).read_bytes() == before, what


@needs_flwr
@pytest.mark.slow
def test_a_client_past_the_timeout_is_dropped_and_replaced(finetune: FinetuneConfig) -> None:
    """Client 0 sleeps past round 1's timeout: the round aggregates client 1 alone, and
    round 2 has both again (client 0 in a fresh process, compiled anew)."""
    from pockengine.federated.engine import simulate

    config = federated(finetune, clients=2, rounds=2, delay=("0:1:60",), timeout=20.0)
    simulate(config)
    rows = rounds_log(finetune)
    assert rows[0]["clients"] == [1] and "did not answer in time" in rows[0]["dropped"][0]
    assert rows[1]["clients"] == [0, 1] and rows[1]["dropped"] == []


@needs_flwr
@pytest.mark.slow
def test_a_resumed_run_ends_with_the_uninterrupted_runs_state(finetune: FinetuneConfig) -> None:
    """Stopped after round 1 and resumed (fresh client processes), a 2-round run ends
    with exactly the global state of the same run never stopped."""
    import dataclasses

    from pockengine.federated.engine import simulate

    config = federated(finetune, clients=2, rounds=2, partition="dirichlet", alpha=1.0)
    simulate(config)
    whole = _global_state(finetune)
    other = dataclasses.replace(finetune, out=f"{finetune.out}-resumed")
    simulate(dataclasses.replace(config, finetune=other, stop_after_round=1))
    simulate(dataclasses.replace(config, finetune=other, resume=True))
    resumed = _global_state(other)
    assert [r["round"] for r in rounds_log(other)] == [1, 2]
    for name, array in whole.items():
        np.testing.assert_array_equal(resumed[name], array, err_msg=name)


def test_batchnorm_statistics_travel_with_the_trained_params() -> None:
    """The running statistics a step updates are averaged like its params (else the
    server evaluates with the statistics every client started from); the integer batch
    counter and the frozen layer stay home."""
    import torch
    import torch.nn.functional as F

    import pockengine as pe
    from pockengine.federated.payload import TrainedSet
    from pockengine.optim import SGD
    from pockengine.sparse import schemes

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )

    x, y = torch.randn(16, 4) * 3 + 1, torch.randint(0, 3, (16,))
    scheme = schemes.select(train=["1.*", "3.*"])

    def compiled() -> pe.TrainStep:
        loss = lambda m, a, b: F.cross_entropy(m(a), b)  # noqa: E731
        return pe.compile(build(), loss, (x, y), SGD(lr=0.1), scheme, backend="torch")

    client, server = compiled(), compiled()
    trained = TrainedSet.of(client)
    assert set(trained.rows) == {"1.weight", "1.bias", "1.running_mean", "1.running_var",
                                 "3.weight", "3.bias"}  # fmt: skip
    client(x, y)
    sent = trained.extract(client)
    assert np.abs(sent["1.running_mean"]).max() > 0.01  # moved from its initial zeros
    trained.merge(server, sent, "a reply")
    for name, value in server.flat_state_dict(list(trained.rows)).items():
        np.testing.assert_array_equal(value, sent[name], err_msg=name)


def test_full_model_bytes_come_from_shapes_without_reading_a_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What full-model FedAvg sends, counted from the step's shapes and dtypes: the bytes
    of ``flat_state_dict()`` (int8 frozen weights as the floats it gives, the tied
    embedding under both names), without reading or dequantizing any tensor."""
    import torch
    import torch.nn.functional as F

    import pockengine as pe
    from pockengine.federated.payload import full_model_bytes
    from pockengine.optim import SGD
    from pockengine.sparse import schemes

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.fc = torch.nn.Linear(16, 16)
            self.bn = torch.nn.BatchNorm1d(16)
            self.out = torch.nn.Linear(16, 32, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.out(self.bn(self.fc(self.emb(ids).mean(1))))
            return out

    torch.manual_seed(0)
    ids, y = torch.randint(0, 32, (8, 5)), torch.randint(0, 32, (8,))
    loss = lambda m, a, b: F.cross_entropy(m(a), b)  # noqa: E731
    step = pe.compile(Tied(), loss, (ids, y), SGD(lr=0.1), schemes.select(train=["bn.*"]),
                      backend="torch", frozen_dtype="int8")  # fmt: skip
    state = step.flat_state_dict()
    assert {"out.weight", "emb.weight"} <= set(state)  # tied: counted under both names
    expected = sum(a.nbytes for a in state.values())
    # the public per-name reads the run folder's writers use
    tied = step.aliases("emb.weight")
    assert set(tied) == {"emb.weight", "out.weight"} and tied[0] == "emb.weight"
    assert step.aliases("fc.bias") == ("fc.bias",)
    assert set(step.quantized) == {"emb.weight", "fc.weight"}
    for name in state:
        np.testing.assert_array_equal(step.value(name), state[name])
    with pytest.raises(KeyError, match="no param or buffer named 'nope'"):
        step.value("nope")

    def no_read(ir: str) -> None:
        raise AssertionError(f"read {ir}")

    monkeypatch.setattr(step, "_read", no_read)
    assert full_model_bytes(step) == expected
    assert step.state_specs() == {n: (a.shape, a.dtype) for n, a in state.items()}
