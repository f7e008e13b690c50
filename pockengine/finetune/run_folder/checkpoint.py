"""Checkpoints: one safetensors file, written atomically, that resumes a run exactly.

A checkpoint holds the params and buffers that training changes (``param/<name>``,
names as in ``model.state_dict()``: ``TrainStep.written``; the frozen weights are the
model's own, loaded again on resume, and a checkpoint of a quantized LLM holds no
dequantized copy of them), the optimizer state (``optim/<name>``: moments, the learning
rate, the step count and the dropout seed ``rng.seed``), the current epoch's data
order (``data/order``) and, as JSON metadata, the counters, the training options,
the scheme, the label names and the data fingerprint.

The file is written to a temporary file in the same folder, flushed, fsynced and
moved over the old one with ``os.replace``, so a crash at any moment leaves either
the previous checkpoint or the new one, never a mixture. ``metrics.jsonl`` lines past
a checkpoint are dropped on resume for the same reason.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from pockengine.ir.arrays import Array
from pockengine.safe_write import write_bytes, write_with
from pockengine.safetensors_io import metadata_of, read_metadata, write_safetensors_to
from pockengine.tasks.config import FinetuneError
from pockengine.tasks.model_files import check_safetensors

__all__ = [
    "CHECKPOINT",
    "FORMAT",
    "Checkpoint",
    "load",
    "load_into_step",
    "read_json_lines",
    "remove_stale_temporaries",
    "save",
    "saved_options",
    "write_atomic",
    "write_atomic_with",
    "write_json_lines",
]
CHECKPOINT = "checkpoint.safetensors"
FORMAT = "pockengine-finetune/1"
_CHUNK = 8 << 20
_GROUPS = ("param", "optim", "data")
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header


@dataclass
class Checkpoint:
    """Everything a run needs to continue where it stopped."""

    params: dict[str, Array]
    optimizer: dict[str, Array]
    order: Array  # the current epoch's example order
    counters: dict[str, int]  # step, epoch, batch (within the epoch), examples
    config: dict[str, Any]  # FinetuneConfig.training_dict()
    scheme: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)  # labels, fingerprint, best metric


def save(path: str | Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` to ``path`` atomically, each array from its own memory (no copy of
    the state is built: on a small device that copy would be the run's peak)."""
    tensors: dict[str, Array] = {}
    for group, entries in (("param", ckpt.params), ("optim", ckpt.optimizer)):
        for name, array in entries.items():
            tensors[f"{group}/{name}"] = np.asarray(array)  # keeps 0-d
    tensors["data/order"] = np.asarray(ckpt.order, dtype=np.int64)
    meta = {
        "format": FORMAT,
        "counters": json.dumps(ckpt.counters),
        "config": json.dumps(ckpt.config),
        "scheme": json.dumps(ckpt.scheme),
        "info": json.dumps(ckpt.info),
    }
    write_with(Path(path), lambda f: write_safetensors_to(f, tensors, meta, _write))


def load(path: str | Path) -> Checkpoint:
    """Read a checkpoint; a ``FinetuneError`` if it is missing or not one of ours."""
    from safetensors import SafetensorError
    from safetensors.numpy import load as from_bytes

    p = Path(path)
    try:
        data = p.read_bytes()
        check_safetensors(p, data)  # a truncated file fails here, before the Rust reader
        tensors = from_bytes(data)
        meta = metadata_of(data)
    except FileNotFoundError as exc:
        raise FinetuneError(f"no checkpoint to resume from at {p}") from exc
    except (OSError, SafetensorError, ValueError) as exc:
        raise FinetuneError(f"{p} is not a readable checkpoint: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise FinetuneError(f"{p} is not a pockengine fine-tuning checkpoint")
    groups: dict[str, dict[str, Array]] = {g: {} for g in _GROUPS}
    try:
        for key, array in tensors.items():
            group, _, name = key.partition("/")
            groups[group][name] = array
        fields = {k: _json_object(meta[k]) for k in ("counters", "config", "scheme", "info")}
        return Checkpoint(
            params=groups["param"],
            optimizer=groups["optim"],
            order=groups["data"]["order"],
            counters={k: int(v) for k, v in fields["counters"].items()},
            config=fields["config"],
            scheme=fields["scheme"],
            info=fields["info"],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise FinetuneError(f"{p} is an incomplete or corrupt checkpoint ({exc!r})") from exc


def load_into_step(step: Any, saved: Checkpoint, what: str) -> None:
    """Load ``saved`` into ``step`` (a ``TrainStep`` rebuilt as the run compiled it): the
    values training changed over the rebuilt model's own (a checkpoint holds only those;
    older ones hold every param, the frozen ones loaded as they are) and the whole
    optimizer state. ``what``: the model, as the error names it."""
    lacking = [n for n in step.written if n not in saved.params]
    if lacking:
        raise FinetuneError(
            f"the checkpoint does not fit {what}: {len(lacking)} "
            f"missing ({', '.join(lacking[:5])}), values training "
            "changes"
        )
    try:
        step.load_state(optimizer=saved.optimizer)
        result = step.load_state(saved.params, strict=False)
    except (KeyError, ValueError) as exc:
        raise FinetuneError(f"the checkpoint does not fit {what}: {exc}") from exc
    if result.unexpected or result.mismatched:
        raise FinetuneError(f"the checkpoint does not fit {what}: {result.describe()}")


def saved_options(path: str | Path) -> dict[str, Any] | None:
    """The training options a checkpoint stored, read from its header alone; None when
    there is no readable checkpoint there (``load`` then says why)."""
    try:
        meta = read_metadata(path, _HEADER_LIMIT)
        return _json_object(meta["config"]) if meta.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text[:40]!r}")
    return value


# -- atomic files ----------------------------------------------------------------------


def _write(f: IO[bytes], data: bytes | memoryview) -> None:
    """Write ``data`` in chunks (one place for tests to interrupt a write)."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        f.write(view[start : start + _CHUNK])


# One helper writes every file (``pockengine.safe_write``); these are its names here.
write_atomic = write_bytes
write_atomic_with = write_with


def remove_stale_temporaries(folder: Path, name: str = CHECKPOINT) -> list[Path]:
    """Delete temporaries a killed writer left behind (never the checkpoint itself)."""
    stale = sorted(folder.glob(f".{name}.*.tmp")) if folder.is_dir() else []
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return stale


def write_json_lines(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace a JSONL file atomically."""
    write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete object lines of a JSONL file (a line a killed run left half written,
    or anything not a JSON object, is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
