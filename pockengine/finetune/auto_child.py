"""``--scheme auto`` with ``--compile-in child``: the analysis in a child process too.

The analysis (``auto_scheme.choose_auto``) needs the model and torch, which the process
that trains must not hold while the compile child runs (``compile_child``).
``choose_in_child(config, folder)`` runs ``python -m pockengine.finetune.auto_child
FOLDER``: the child builds the task, chooses the scheme (or reads the choice from the
cache) and writes ``choice.json`` (``AutoChoice.to_dict``), then exits; the caller gives
the chosen scheme to the compile child and the choice to the summary. So a run with
``--scheme auto`` never holds two copies of torch and the model, at the price of building
the task once more (model, tokenizer, the data encoded). This module imports no torch. A
child that fails writes ``error.json`` (the error's class and message), raised here again
as it was.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pockengine.finetune.child import child_main, read_job, run_child
from pockengine.finetune.config import FinetuneConfig

__all__ = ["choose_in_child", "main"]

JOB, CHOICE, ERROR = "auto-job.json", "choice.json", "auto-error.json"


def choose_in_child(config: FinetuneConfig, folder: Path) -> dict[str, Any]:
    """The ``AutoChoice`` (as a dict) that a child process makes for ``config``."""
    run_child(__name__, folder, JOB, {"config": config.to_dict()}, ERROR,
              "choosing the auto scheme")  # fmt: skip
    choice: dict[str, Any] = json.loads((folder / CHOICE).read_text())
    return choice


def choose_into(folder: Path) -> None:
    """The child's work: build the task of ``JOB`` in ``folder``, choose, write ``CHOICE``."""
    from pockengine.finetune import recipes
    from pockengine.finetune.auto_scheme import choose_auto
    from pockengine.finetune.estimate import EstimateSettings
    from pockengine.runtime import release_free_memory

    job = read_job(folder, JOB)
    config = FinetuneConfig(**job["config"])
    settings = EstimateSettings(score=config.auto_score)
    assert config.batch_size is not None
    # the batches the analysis reads, not the whole data (freed before the first import)
    task = recipes.build(config).for_analysis(config.batch_size, settings.batches)
    release_free_memory()
    sparse = recipes.RECIPES[recipes.recipe_name(config)].sparse
    choice = choose_auto(config, task, sparse, settings)
    (folder / CHOICE).write_text(json.dumps(choice.to_dict()))


def main(argv: list[str]) -> int:
    """``python -m pockengine.finetune.auto_child FOLDER`` (``choose_in_child``)."""
    return child_main(argv, choose_into, ERROR)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
