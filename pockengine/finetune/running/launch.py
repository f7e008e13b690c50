"""Where a fine-tune starts: the checks, the run folder's lock, the compile, then training.

``run(config)`` (``pe.finetune``, ``pockengine finetune``) checks the options, fills in
the recipe's defaults, parses the scheme, checks the model folder, takes ``RUN``'s lock
and finds the checkpoint to resume, all without torch. With ``--compile-in child``
(the default) the compile child then runs while this process still holds no torch, so
the machine never holds this process's torch and the child's at once; only then does
this process import the trainer (and torch) and train the step the child wrote.
``--scheme auto`` chooses its scheme in the compile child, before it compiles the
choice (the task is built once); ``--resume`` of an auto run compiles, in the child too,
the scheme its checkpoint trained. With ``--compile-in process``, or a task whose
evaluation does not compile (it runs eagerly on the model: the child says so, and the
compile is done again here), the trainer builds and compiles the task in this process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pockengine import status_lines
from pockengine.finetune.compiling.compile_child import compile_in_child
from pockengine.finetune.run_folder import checkpoint as ckpt_io
from pockengine.finetune.run_folder.best import BEST
from pockengine.finetune.running.run_lock import RunLock
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme
from pockengine.tasks import recipe_table
from pockengine.tasks.config import FinetuneConfig, FinetuneError

if TYPE_CHECKING:
    from pockengine.finetune.running.result import FinetuneResult

__all__ = ["resume_point", "run"]

log = logging.getLogger(__name__)
_AUTO = "auto"  # auto_scheme.AUTO, which this module cannot import: it imports torch


def run(config: FinetuneConfig) -> FinetuneResult:
    """Fine-tune as ``config`` says; returns when done, stopped, or raises."""
    start = time.perf_counter()
    status_lines.configure(config.progress)
    config = _scheme_when_resumed(config.validate())
    config = config.with_defaults(recipe_table.defaults(config)).validate()
    assert config.scheme is not None, "filled in by the recipe's defaults"
    given = config.scheme
    scheme = (
        None
        if given == _AUTO
        else recipe_table.parse_scheme(given, recipe_table.recipe_name(config), config.batchnorm)
    )
    recipe_table.check_model_files(config)
    out = _out(config)
    with RunLock(out, config.force):
        return _compile_and_train(config, scheme, out, resume_point(config, out), start)


def _compile_and_train(
    config: FinetuneConfig,
    scheme: Scheme | None,
    out: Path,
    saved: ckpt_io.Checkpoint | None,
    start: float,
) -> FinetuneResult:
    """Once ``out`` is held: compile in a child and train here, or do both here."""
    if config.compile_in != "child" or _bucketed(config):
        from pockengine.finetune.running.trainer import train_here

        return train_here(config, scheme, out, saved, start)
    if scheme is None and saved is not None:  # --resume of an auto run: the scheme it chose
        scheme = schemes.from_dict(saved.scheme)
    with tempfile.TemporaryDirectory(prefix=".compiled-", dir=out) as folder:
        compile_start = time.perf_counter()
        auto = ", the scheme (--scheme auto)" if scheme is None else ""
        status_lines.say(f"compiling in a child process: the model and data{auto}, the step")
        compiled, choice = compile_in_child(config, scheme, Path(folder))
        chosen = schemes.from_dict(choice["scheme"]) if choice is not None else scheme
        assert chosen is not None
        from pockengine.finetune.running.trainer import train_compiled, train_here

        if not compiled:  # auto: the choice is read back from its cache, for the summary
            log.warning(
                "the task's evaluation does not compile and runs on the model: "
                "compiling here (--compile-in process)"
            )
            return train_here(config, scheme, out, saved, start)
        return train_compiled(
            config, chosen, out, saved, (start, compile_start), Path(folder), choice
        )


def _bucketed(config: FinetuneConfig) -> bool:
    """Whether the run compiles a step per length bucket (``--packing off`` on a causal
    LM), which it does in this process: a compile child hands back one step."""
    lm = recipe_table.recipe_name(config) in ("generic-lm", "smollm2-pyqa")
    return lm and config.packing == "off" and config.buckets > 1


def _out(config: FinetuneConfig) -> Path:
    return Path(config.out or Path("runs") / _slug(config))


def _scheme_when_resumed(config: FinetuneConfig) -> FinetuneConfig:
    """``--resume`` without ``--scheme`` (``--batchnorm``) trains the scheme (BatchNorm
    mode) the run started with, so a run begun under another default (``sparse``, before
    ``auto``; batch statistics, before lite0-fashion's running ones) resumes as it was. A
    checkpoint older than ``--batchnorm`` trained on batch statistics."""
    if not config.resume or (config.scheme is not None and config.batchnorm is not None):
        return config
    saved = ckpt_io.saved_options(_out(config) / ckpt_io.CHECKPOINT)
    if saved is None:
        return config
    scheme, batchnorm = saved.get("scheme"), saved.get("batchnorm") or "batch"
    if config.scheme is None and isinstance(scheme, str):
        config = dataclasses.replace(config, scheme=scheme)
    if config.batchnorm is None and isinstance(batchnorm, str):
        config = dataclasses.replace(config, batchnorm=batchnorm)
    return config


def _slug(config: FinetuneConfig) -> str:
    name = config.recipe or Path(str(config.model)).name or "model"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def resume_point(config: FinetuneConfig, out: Path) -> ckpt_io.Checkpoint | None:
    """The checkpoint to continue (``resume``), after checking it is this run's."""
    path = out / ckpt_io.CHECKPOINT
    ckpt_io.remove_stale_temporaries(out)
    if not config.resume:
        if path.exists():
            raise FinetuneError(
                f"{out} already holds a checkpoint: continue it with --resume, "
                "or choose another --out"
            )
        for stale in ("metrics.jsonl", "summary.json", BEST):  # never checkpointed
            (out / stale).unlink(missing_ok=True)
        return None
    saved = ckpt_io.load(path)
    now = json.loads(json.dumps(config.training_dict()))
    # an option newer than the checkpoint had its default then (``--batchnorm``, whose
    # default is now the recipe's, was "batch")
    defaults = json.loads(json.dumps(FinetuneConfig(batchnorm="batch").training_dict()))
    before = {**{k: v for k, v in defaults.items() if k not in saved.config}, **saved.config}
    diffs = [
        f"{k}: {before.get(k)!r} in the checkpoint, {v!r} now"
        for k, v in now.items()
        if before.get(k) != v
    ]
    if diffs:
        raise FinetuneError(
            "--resume continues a run with the options it started with; "
            "these differ:\n  " + "\n  ".join(diffs)
        )
    return saved
