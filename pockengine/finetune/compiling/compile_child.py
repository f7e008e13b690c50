"""``pockengine finetune --compile-in child``: compile in a child process, train here.

What the device sees is the whole-process peak of the process that trains. Compiling
there costs the model's framework code (transformers, torch.export, sympy), the tokenizer,
the float model and the compiler's leftovers, none of which the training loop reads.
``compile_in_child(config, scheme, folder)`` runs ``python -m
pockengine.finetune.compiling.compile_child FOLDER``, which builds the task (model, tokenizer, the
data encoded), compiles the step and its evaluator as the run would
(``task_step.compile_task``, ``task_step.compile_evaluator_releasing``) and writes into ``FOLDER``:

- ``step/``: the step artifact with its evaluator (``pockengine.step.artifact``);
- ``task.safetensors`` and ``task.json``: the encoded splits, the labels, the notes, how
  ``RUN/model`` is written, and the model's buffer names (``compiled_task``);
- ``model/``: the skeleton of ``RUN/model`` (``model_skeleton``).

The splits are written first; the child then keeps one training batch and one evaluation
batch of them (``Task.holding``), so its peak does not hold the data while it compiles.
With ``--scheme auto`` (the job's scheme is None) the child first keeps the batches the
analysis reads (``Task.for_analysis``), chooses the scheme (``auto_scheme.choose_auto``,
or the cached choice), writes ``choice.json`` and frees what the analysis held, then
compiles the choice: the task is built once for both, in one process.
Then it exits, and the process that trains loads the step (``compiled_task.load_compiled``).
This module imports no torch: the parent (``launch.run``) has not imported it while the
child compiles, so the two processes never hold torch at once. A child that fails writes
``error.json`` (the error's class and message), raised here again as it was
(``finetune.compiling.child``, the protocol both helper processes share). A task whose
evaluation does not compile runs eagerly on the model, which only the process that
compiled has: the child writes ``needs-model.txt`` instead, and the run compiles in-process.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pockengine import status_lines
from pockengine.finetune.compiling.child import child_main, read_job, run_child
from pockengine.finetune.compiling.child_folder import (
    CHOICE,
    ERROR,
    JOB,
    MODEL_DIR,
    NEEDS_MODEL,
    STEP_DIR,
)
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme, resolve_scheme
from pockengine.tasks.config import FinetuneConfig, FinetuneError

if TYPE_CHECKING:
    from torch import nn

    from pockengine.scheme_choice.estimate import EstimateSettings
    from pockengine.step.compiler import TrainStep
    from pockengine.tasks.recipes import Task

__all__ = ["compile_in_child", "compile_into", "frozen_given", "main"]

log = logging.getLogger(__name__)


def compile_in_child(
    config: FinetuneConfig, scheme: Scheme | None, folder: Path
) -> tuple[bool, dict[str, Any] | None]:
    """Compile ``config``'s task in a child process writing into ``folder``; raise its
    error here. ``scheme`` None: ``--scheme auto``, chosen in the child first. Returns
    whether the step compiled (False: the task's evaluation does not compile, so the
    eager evaluation needs the model in the process that trains; the caller compiles
    there instead) and the auto choice (``AutoChoice.to_dict``; None for a given
    scheme)."""
    job = {"config": config.to_dict(), "scheme": None if scheme is None else scheme.to_dict(),
           "started": status_lines.started()}  # fmt: skip
    what = "compiling" if scheme is not None else "choosing the auto scheme and compiling"
    run_child(__name__, folder, JOB, job, ERROR, what)
    choice = None
    if scheme is None:
        try:
            choice = json.loads((folder / CHOICE).read_text())
        except (OSError, ValueError) as e:
            raise FinetuneError(
                f"{folder / CHOICE}: the auto choice the compile child "
                f"wrote is missing or damaged ({e})"
            ) from e
    return not (folder / NEEDS_MODEL).exists(), choice


def compile_into(folder: Path, phase: Callable[[str], None] = lambda _: None) -> None:
    """The child's work: build the task (``JOB`` in ``folder``), compile the step and its
    evaluator, write them; ``phase(label)`` is called after each phase
    (``benchmarks/child_memory.py`` prints the memory there).

    The child holds what the step needs once: the float copies of the weights the step
    takes as GGUF blocks are replaced by stand-ins before the trace, and those it
    quantizes (int8, int4) right after compiling; the step shares the params it trains
    with the model (``copies_deferred``: it never runs here), and its optimizer state's
    zeros are never written, in memory or in the artifact (``artifact``)."""

    from pockengine.finetune.compiling.compiled_task import save_task_data
    from pockengine.finetune.compiling.task_step import compile_evaluator_releasing, compile_task
    from pockengine.finetune.run_folder import released
    from pockengine.frontend.import_memo import reused_imports
    from pockengine.safetensors_io import pages_out_after_write
    from pockengine.scheme_choice.estimate import EstimateSettings
    from pockengine.step.compiler import release_free_memory
    from pockengine.step.running import copies_deferred
    from pockengine.tasks import recipes
    from pockengine.tasks.gguf import frozen_weights
    from pockengine.tasks.metrics import CAUSAL_LM_BATCH, CLASSIFY_BATCH

    job = read_job(folder, JOB)
    config = FinetuneConfig(**job["config"])
    status_lines.configure(config.progress, job.get("started"))
    assert config.batch_size is not None
    task = recipes.build(config)
    status_lines.say(f"model and data ready: {task.train_size:,} training examples")
    phase("model, tokenizer and data")
    # The splits go to the process that trains now; the compile keeps the batches it
    # traces on (a training batch, an evaluation batch) and frees the rest first; an
    # auto run's analysis also reads the last batches of the training split.
    save_task_data(folder, task)
    val = max(CLASSIFY_BATCH, CAUSAL_LM_BATCH)
    # the analysis' import of the run's batch is the compile's (one torch.export fewer)
    with reused_imports() as memo:
        if job["scheme"] is None:
            settings = EstimateSettings(score=config.auto_score)
            task = task.for_analysis(config.batch_size, settings.batches, val)
            release_free_memory()
            scheme = _choose(folder, config, task, settings)
            memo.keep(config.batch_size)  # not the micro-batches' imports
            phase("auto scheme chosen")
        else:
            scheme = schemes.from_dict(job["scheme"])
        task = task.holding(config.batch_size, val=val)
        release_free_memory()
        phase("data written, all but a batch of each split released")
        frozen = frozen_weights(config)
        _stand_in(task.model, frozen_given(task.model, frozen.given, scheme))  # stored as blocks
        phase("GGUF blocks read, the float copies of them released")
        status_lines.say(f"compiling the training step ({config.backend} backend)")
        with copies_deferred():  # the step never runs here: it shares what it would write
            step = compile_task(config, task, scheme, frozen)
        if memo.reused:
            log.info("the compile reused %d import(s) of the analysis", memo.reused)
    _stand_in(task.model, released.quantized_names(step))  # int8, int4: quantized now
    phase("step compiled")
    status_lines.say("compiling the evaluation")
    evaluator = compile_evaluator_releasing(step, task)  # the model's copies released
    phase("evaluator compiled")
    if evaluator is None:  # only a compiled evaluation runs without the model
        (folder / NEEDS_MODEL).write_text("the task's evaluation does not compile")
        return
    # The weights a loader memory-mapped were never read here: reading them to write
    # them would make them all resident (+84 MiB for minilm-bbc); each is paged out
    # once written instead. Nothing runs after this in the child.
    status_lines.say("writing the compiled step for the process that trains")
    with pages_out_after_write():
        step.save(folder / STEP_DIR, evaluator)
        phase("step artifact written")
        _write_task(folder, step, task)
    phase("task and the RUN/model skeleton written")


def _choose(folder: Path, config: FinetuneConfig, task: Task, settings: EstimateSettings) -> Scheme:
    """``--scheme auto``'s analysis on ``task`` (the batches it reads), here before the
    compile, so the run builds the task once: the choice goes to ``CHOICE``, and what the
    analysis held (its imports of the model, its gradient steps) is freed before the
    compile starts."""
    import gc

    from pockengine.scheme_choice.auto_scheme import choose_auto
    from pockengine.step.compiler import release_free_memory
    from pockengine.tasks import recipes

    sparse = recipes.RECIPES[recipes.recipe_name(config)].sparse
    choice = choose_auto(config, task, sparse, settings)
    (folder / CHOICE).write_text(json.dumps(choice.to_dict()))
    scheme = choice.scheme
    del choice
    gc.collect()
    release_free_memory()
    return scheme


def frozen_given(model: nn.Module, given: Iterable[str], scheme: Scheme) -> list[str]:
    """The weights in ``given`` (GGUF blocks, by model name) that ``scheme`` does not
    train: the step stores those as the blocks (a trained one starts from the model's
    float values, so it keeps them), under any of their tied names."""
    from pockengine.frontend.torch import torch_model_info

    info = torch_model_info(model)
    trained = resolve_scheme(scheme, info).names
    return [n for n in given if info.canonical.get(n, n) not in trained and n not in trained]


def _stand_in(model: nn.Module, names: Iterable[str]) -> None:
    from pockengine.finetune.run_folder.released import stand_in
    from pockengine.step.compiler import release_free_memory

    if stand_in(model, names):
        release_free_memory()


def _write_task(folder: Path, step: TrainStep, task: Task) -> None:
    from pockengine.finetune.compiling.compiled_task import save_task_info
    from pockengine.finetune.compiling.model_skeleton import write_skeleton
    from pockengine.finetune.run_folder import released

    save_task_info(folder, task)  # (its data was written first: compile_into)
    write_skeleton(
        folder / MODEL_DIR,
        task,
        released.step_values(step, copy=False),
        released.quantized_stand_ins(step),
    )


def main(argv: list[str]) -> int:
    """``python -m pockengine.finetune.compiling.compile_child FOLDER`` (``compile_in_child``)."""
    return child_main(argv, compile_into, ERROR)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
