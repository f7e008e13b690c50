"""Bounded work in a federated run: every client gets a batch or nothing starts, at most
``--parallel`` client processes, and a round in which no client trained is an error.
Runs the tiny task of ``tests/test_federated.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pockengine.federated import FederatedError
from pockengine.finetune import FinetuneConfig
from tests.test_federated import federated, finetune, needs_flwr, rounds_log

__all__ = ["finetune"]  # the fixture


def _cli(ft: FinetuneConfig, *options: str) -> list[str]:
    return [
        "federated", "--model", str(ft.model), "--data", str(ft.data), "--text-column",
        "review", "--label-column", "sentiment", "--seq-len", "12", "--batch-size", "8",
        "--scheme", str(ft.scheme), "--out", str(ft.out), *options,
    ]  # fmt: skip


@needs_flwr
def test_more_clients_than_batches_is_refused_before_anything_starts(
    finetune: FinetuneConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """240 rows, 20% held out: 192 training examples, 24 batches of 8; 25 clients."""
    from pockengine.cli import main
    from pockengine.federated import deployment, engine

    started: list[Any] = []
    monkeypatch.setattr(engine.ProcessGrid, "_start", lambda self, w: started.append(w))
    monkeypatch.setattr(deployment.LocalFederation, "start", lambda self: started.append(self))
    for extra in ([], ["--partition", "dirichlet"], ["--deployment", "--parallel", "25"]):
        assert main(_cli(finetune, "--clients", "25", *extra)) == 2
        err = capsys.readouterr().err
        assert "192 training examples make 24 batch(es) of 8, fewer than the 25 clients" in err
        assert "use --clients 24 or fewer, a smaller --batch-size, or more data" in err
        assert err.count("error:") == 1 and started == []
        assert not Path(str(finetune.out)).exists() or not any(Path(str(finetune.out)).iterdir())
    assert main(_cli(finetune, "--clients", "4", "--deployment", "--parallel", "2")) == 2
    err = capsys.readouterr().err
    assert "4 clients exceed --parallel 2; use --clients 2 or fewer" in err and started == []
    assert main(_cli(finetune, "--parallel", "0")) == 2
    assert "--parallel" in capsys.readouterr().err


@needs_flwr
def test_clients_share_at_most_parallel_processes_and_a_round_nobody_trained_is_an_error(
    finetune: FinetuneConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 clients in 2 processes: round 1 trains all three (clients 0 and 2 share a
    process and its compiled step); in round 2 every client fails, which stops the run
    with round 1's state saved, instead of a round that sends up 0 B."""
    from safetensors import safe_open

    from pockengine.federated.engine import ProcessGrid, simulate

    alive_at_start: list[int] = []
    processes: list[Any] = []
    start = ProcessGrid._start

    def counted(self: ProcessGrid, worker: int) -> None:
        alive_at_start.append(sum(p.is_alive() for p in processes))
        start(self, worker)
        processes.append(self._workers[worker].process)

    monkeypatch.setattr(ProcessGrid, "_start", counted)
    config = federated(finetune, clients=3, parallel=2, rounds=2,
                       fail=("0:2", "1:2", "2:2"))  # fmt: skip
    with pytest.raises(FederatedError) as info:
        simulate(config)
    message = str(info.value)
    assert "round 2: no client trained" in message and "client 0 fails in round 2" in message
    assert "the saved global state is that of round 1" in message and "--resume" in message
    assert alive_at_start == [0, 1]  # two processes for three clients, never a third
    rows = rounds_log(finetune)
    assert [r["round"] for r in rows] == [1] and rows[0]["clients"] == [0, 1, 2]
    assert rows[0]["dropped"] == [] and rows[0]["bytes_up"] > 0
    out = Path(str(finetune.out))
    with safe_open(str(out / "global.safetensors"), "np") as saved:
        assert saved.metadata()["round"] == "1"
    assert not (out / "summary.json").exists()


def test_parallel_is_checked_and_not_a_training_option() -> None:
    assert federated(FinetuneConfig(), clients=8, parallel=3).processes() == 3
    assert federated(FinetuneConfig(), clients=2, parallel=16).processes() == 2
    with pytest.raises(FederatedError, match="parallel must be a positive integer, got 0"):
        federated(FinetuneConfig(), parallel=0).validate()
    saved = json.loads(json.dumps(federated(FinetuneConfig(), parallel=1).training_dict()))
    assert federated(FinetuneConfig(), parallel=4).trains_as_saved(saved)  # resumes


def test_clients_sharing_a_process_train_as_clients_alone(finetune: FinetuneConfig) -> None:
    """One compiled step serving clients 0 and 1 in turn (as a worker under --parallel
    hosts them) gives each exactly what a step of its own gives, dropout included."""
    import numpy as np

    from pockengine.federated.local import LocalTrainer

    config = federated(finetune, clients=2, rounds=2)
    shared = LocalTrainer(config, 0)
    start = shared.trained.extract(shared.step)
    first0 = shared.serve(0).train(start, 1, 0.0).arrays
    first1 = shared.serve(1).train(start, 1, 0.0).arrays
    second0 = shared.serve(0).train(first1, 2, 0.0).arrays
    alone1 = LocalTrainer(config, 1).train(start, 1, 0.0).arrays
    alone0 = LocalTrainer(config, 0)
    pairs = [(first0, alone0.train(start, 1, 0.0).arrays), (first1, alone1),
             (second0, alone0.train(first1, 2, 0.0).arrays)]  # fmt: skip
    for got, want in pairs:
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not np.array_equal(first0["head.weight"], first1["head.weight"])  # other shards
