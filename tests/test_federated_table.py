"""benchmarks/federated_table.py: the runs it plans, and the table it reads from their
files (``rounds.jsonl`` and ``summary.json`` as ``pockengine federated`` and
``pockengine finetune`` write them)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def table() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "federated_table", ROOT / "benchmarks" / "federated_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations there
    spec.loader.exec_module(module)
    return module


def _federated(out: Path, accuracy: list[float], bytes_up: int, lr: float) -> None:
    out.mkdir(parents=True)
    rows = [
        {"round": r + 1, "accuracy": a, "loss": 1.0 - a, "bytes_up": bytes_up,
         "bytes_down": bytes_up, "bytes_full_model": 1000, "clients": [0, 1], "dropped": []}
        for r, a in enumerate(accuracy)
    ]  # fmt: skip
    (out / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"config": {"finetune": {"lr": lr}}, "initial": {"accuracy": 0.2},
               "trained_tensors": {"w": [2, 2]}, "wall_s": 1.0}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))


def _central(out: Path, accuracy: list[float]) -> None:
    out.mkdir(parents=True)
    history = [{"event": "eval", "epoch": e + 1, "val_accuracy": a, "val_loss": 1.0 - a}
               for e, a in enumerate(accuracy)]  # fmt: skip
    summary: dict[str, Any] = {
        "config": {"lr": 1e-3}, "epochs_done": len(accuracy), "history": history,
        "final": history[-1], "train_examples": 64, "val_examples": 16, "wall_s": 1.0,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))


def test_the_central_run_has_the_same_data_options_and_as_many_passes(table: ModuleType) -> None:
    args = argparse.Namespace(
        recipe="minilm-bbc", seq_len=32, image_size=None, max_train=640, max_val=200, seed=3,
        backend="torch", clients=10, rounds=4, local_epochs=2, alpha=0.5, full_lr=5e-4,
        runs=Path("/r"), server_optimizer=None, server_lr=None, server_momentum=0.9,
        server_betas=None, server_tau=None, bn_statistics=None,
        scheme_file=["/s/sparse-c50.json"],
    )  # fmt: skip
    runs = {r.name: table.command(r, args) for r in table.plan(args)}

    def option(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert set(runs) == {"fed-sparse", "central-sparse", "fed-full", "fed-full-lr0.0005",
                         "fed-sparse-c50"}  # fmt: skip
    assert option(runs["fed-sparse-c50"], "--scheme") == "/s/sparse-c50.json"

    for name in ("--recipe", "--seq-len", "--max-train", "--max-val", "--seed", "--backend"):
        assert len({option(cmd, name) for cmd in runs.values()}) == 1, name
    assert (
        runs["central-sparse"][0] == "finetune"
        and option(runs["central-sparse"], "--epochs") == "8"
    )
    assert option(runs["fed-full"], "--scheme") == "full" and "--lr" not in runs["fed-full"]
    assert option(runs["fed-full-lr0.0005"], "--lr") == "0.0005"
    assert option(runs["fed-sparse"], "--partition") == "dirichlet"
    for name in ("fed-sparse", "fed-full", "fed-sparse-c50"):  # the same server step
        assert option(runs[name], "--server-momentum") == "0.9" and "--server-lr" not in runs[name]
    assert "--server-momentum" not in runs["central-sparse"]


def test_reads_the_runs_and_writes_the_table_between_its_markers(
    table: ModuleType, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    _federated(runs / "fed-sparse", [0.5, 0.8, 0.75], bytes_up=150, lr=1e-3)
    _federated(runs / "fed-full", [0.6, 0.9, 0.85], bytes_up=1000, lr=1e-4)
    _central(runs / "central-sparse", [0.7, 0.9, 0.8])
    doc = tmp_path / "federated.md"
    doc.write_text("# Federated\n\nbefore\n")
    argv = ["--reuse", "--runs", str(runs), "--doc", str(doc), "--results", str(tmp_path)]
    for _ in range(2):  # the second run replaces the table
        table.main(argv)
    result = json.loads((tmp_path / "federated-minilm-bbc.json").read_text())
    sparse = result["rows"]["fed-sparse"]
    assert (sparse["final_accuracy"], sparse["best_accuracy"]) == (0.75, 0.8)
    assert sparse["bytes_up"] == 450 and sparse["bytes_up_per_round"] == 150
    cmp = result["compare"]
    assert cmp["up_ratio_vs_full_fedavg"] == pytest.approx(450 / 3000)
    assert cmp["points_below_central"] == pytest.approx(5.0)
    assert cmp["points_below_full_fedavg"] == pytest.approx(10.0)
    text = doc.read_text()
    assert text.startswith("# Federated\n\nbefore\n") and text.count("federated-table:") == 2
    assert "| fed-sparse (3 rounds) | 0.001 | 0.7500 | 0.8000 |" in text
    assert "| central-sparse (3 epochs) | 0.001 | 0.8000 | 0.9000 |" in text
    assert "ends 5.00 points below central training and 10.00 points below full-model" in text


def test_the_server_optimizer_goes_to_every_federated_run(table: ModuleType) -> None:
    args = argparse.Namespace(
        recipe="lite0-fashion", seq_len=None, image_size=32, max_train=2000, max_val=300, seed=0,
        backend="torch", clients=10, rounds=10, local_epochs=1, alpha=0.5, full_lr=None,
        runs=Path("/r"), server_optimizer="adam", server_lr=0.003, server_momentum=None,
        server_betas=[0.9, 0.99], server_tau=None, bn_statistics=None, client_lr=0.001,
        scheme_file=["/s/sparse-c50.json"], local_loss="logit-adjusted", la_tau=0.5,
    )  # fmt: skip
    runs = {r.name: table.command(r, args) for r in table.plan(args)}
    server = ["--server-optimizer", "adam", "--server-lr", "0.003", "--server-betas", "0.9", "0.99",
              "--local-loss", "logit-adjusted", "--la-tau", "0.5"]  # fmt: skip
    for name in ("fed-sparse", "fed-full"):
        cmd = " ".join(runs[name])
        assert " ".join(server) in cmd and "--server-momentum" not in cmd, name
    assert "--server-optimizer" not in runs["central-sparse"]
    lr = {name: cmd[cmd.index("--lr") + 1] if "--lr" in cmd else None for name, cmd in runs.items()}
    assert lr == {"fed-sparse": "0.001", "fed-sparse-c50": "0.001", "fed-full": None,
                  "central-sparse": None}  # fmt: skip
    assert " ".join(server) in table._command_line(args)
