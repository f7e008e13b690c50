"""A federated run's folder: where it is and the files the server writes into it (the
global trained state, the round log, the summary)."""

from __future__ import annotations

from pathlib import Path

from pockengine.federated.config import FederatedConfig

__all__ = ["GLOBAL_STATE", "ROUNDS", "SUMMARY", "out_dir"]

GLOBAL_STATE, ROUNDS, SUMMARY = "global.safetensors", "rounds.jsonl", "summary.json"


def out_dir(config: FederatedConfig) -> Path:
    ft = config.finetune
    return Path(ft.out or Path("runs") / f"federated-{ft.recipe or 'generic'}")
