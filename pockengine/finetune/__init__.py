"""Fine-tuning for real: recipes on real weights and data, checkpoints, resume.

    import pockengine as pe
    result = pe.finetune()                                # minilm-bbc, the default recipe
    result = pe.finetune(scheme="head", max_train=200, epochs=1, out="runs/try")
    result = pe.finetune(model="mypkg.models:small", data="reviews.csv", resume=True)
    print(result.summary())

``pockengine finetune --help`` lists the same options and the recipes (minilm-bbc,
minilm-tweets, lite0-fashion, smollm2-pydocs, or your model on your data). The
modules: ``config`` (options, ``FinetuneError``, ``DEFAULT_BACKEND``), ``data``
(datasets, splits, tokenisation), ``models``, ``vision``, ``causal_lm``, ``recipe_table``
and ``recipes`` (what trains on what), ``launch`` (checks, lock, the compile child),
``trainer`` (the loop), ``metrics`` (evaluation, the JSONL
log), ``checkpoint`` (safetensors, atomic), ``progress`` (the bar), ``result`` and
``cli`` (the command's options). Only this module is imported by ``pockengine``
itself; torch is imported when a run compiles (``--compile-in process``) or once
its compile child is done (``--compile-in child``, the default).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from pockengine.tasks.config import (
    DEFAULT_BACKEND,
    DEFAULT_RECIPE,
    FinetuneConfig,
    FinetuneError,
)

if TYPE_CHECKING:
    from pockengine.finetune.running.result import FinetuneResult

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_RECIPE",
    "FinetuneConfig",
    "FinetuneError",
    "finetune",
]


def finetune(config: FinetuneConfig | None = None, /, **options: Any) -> FinetuneResult:
    """Fine-tune a model (a recipe, or ``model=`` and ``data=``) and return the result.

    ``options`` are ``FinetuneConfig`` fields; they override ``config``'s.
    """
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise FinetuneError(f"unknown finetune options {unknown}; options: {sorted(names)}")
    paths = {k: os.fspath(v) for k, v in options.items() if isinstance(v, os.PathLike)}
    config = dataclasses.replace(config or FinetuneConfig(), **{**options, **paths})
    if ("model" in options or "data" in options) and "recipe" not in options:
        config = dataclasses.replace(config, recipe=None)
    from pockengine.finetune.running import launch  # torch is imported once the compile is done

    return launch.run(config)
