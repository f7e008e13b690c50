"""Fine-tuning for real: recipes on real weights and data, checkpoints, resume.

    import pockengine as pe
    result = pe.finetune()                                # minilm-bbc, the default recipe
    result = pe.finetune(scheme="head", max_train=200, epochs=1, out="runs/try")
    result = pe.finetune(model="mypkg.models:small", data="reviews.csv", resume=True)
    print(result.summary())

``pockengine finetune --help`` lists the same options and the recipes (minilm-bbc,
minilm-tweets, lite0-fashion, smollm2-pydocs, or your model on your data). The options,
models, data and recipes a run trains are ``pockengine.tasks`` (``FinetuneConfig`` and
``FinetuneError`` are re-exported here); choosing the scheme (``--scheme auto``) is
``pockengine.scheme_choice``. This package is the run built on them:

- ``running``: ``launch`` (checks, lock, the compile child), ``trainer`` and ``loop`` (the
  training loop), ``progress`` (the bar), ``curves``, ``result``, ``run_lock``;
- ``compiling``: compiling the run's step (``task_step``), in a child process
  (``compile_child``, ``child``, ``child_folder``, ``compiled_task``, ``model_skeleton``);
- ``run_folder``: what a run writes and how it is read back (``home``, ``home_load``,
  ``checkpoint``, ``best``, ``metrics_log``, ``adapter``, ``released``, ``run_files``,
  ``run_meta``);
- ``trained``: tools for a trained run (``generation``, ``lm_chat``, ``run_eval``,
  ``lm_eval``, ``gguf_lora``);
- ``cli``: the command's options.

``import pockengine`` does not import this package; ``pe.finetune`` does on first use
(it is this module, which calls as ``finetune``). torch is imported when a run compiles
(``--compile-in process``) or once its compile child is done (``--compile-in child``, the
default).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
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


class _CallableModule(types.ModuleType):
    """This package, callable as ``finetune``: ``pe.finetune(...)`` runs a fine-tune
    whether ``pe.finetune`` was first reached through ``pockengine`` or by importing a
    submodule (which binds the package, not the function, to ``pockengine.finetune``)."""

    def __call__(self, config: FinetuneConfig | None = None, /, **options: Any) -> FinetuneResult:
        return finetune(config, **options)


sys.modules[__name__].__class__ = _CallableModule
