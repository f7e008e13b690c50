"""The run's model in its home format: ``RUN/model/``, and the best weights kept for it.

At each validation ``BestWeights.offer`` keeps the weights of the best validation so far
(ties: the latest): only the values training changes (the trained params and the
model's buffers), read from the torch model that validation has just loaded, written
atomically to ``RUN/best.safetensors`` so that ``--resume`` keeps them too. At the end of
an invocation ``write_model`` loads the last (``--keep last``) or the best weights into the
task's torch model and writes it where it came from, by the recipe's ``Task.home``:

- ``hf-classifier``: the encoder as ``save_pretrained`` writes it (config,
  ``model.safetensors``, tokenizer files), the linear head in ``head.safetensors``
  (``weight``, ``bias``), pooling, labels and sequence length in ``pockengine.json``;
- ``hf-causal-lm``: the whole ``save_pretrained`` folder (``AutoModelForCausalLM`` loads it);
- ``factory`` and ``vision``: ``model.safetensors`` under the model's own ``state_dict``
  keys, and in ``pockengine.json`` how to rebuild the module (the factory and its
  arguments; the builder and the image preprocessing), the word vocabulary if any.

Names need no table: ``TrainStep.flat_state_dict`` already gives the values under the
torch model's ``state_dict`` names (the frontend's record of each param and buffer), so
the values are loaded into the model and written from it. The folder is written beside
``RUN/model`` and renamed into place, so it is never half written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.finetune import checkpoint as ckpt_io
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.finetune.data import WordTokenizer
from pockengine.finetune.recipes import Task
from pockengine.safetensors_io import write_safetensors_to

__all__ = [
    "BEST",
    "FORMAT",
    "META",
    "MODEL_DIR",
    "BestWeights",
    "classifier_snippet",
    "write_model",
]

BEST = "best.safetensors"
MODEL_DIR = "model"
META = "pockengine.json"
FORMAT = "pockengine-model/1"
Array = np.ndarray[Any, Any]


def best_metric(kind: str) -> tuple[str, bool]:
    """The validation metric that ranks a task's weights, and whether higher is better."""
    return ("val_loss", False) if kind == "causal-lm" else ("val_accuracy", True)


class BestWeights:
    """The best validation so far (``row``) and its changed values (``BEST`` on disk)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.metric, self.higher = best_metric(kind)
        self.row: dict[str, Any] | None = None

    def offer(self, row: dict[str, Any], model: nn.Module, trained: Iterable[str]) -> bool:
        """Keep ``model``'s values that training changes (``changed_names``) if ``row`` is at
        least as good as the best so far."""
        value = row.get(self.metric)
        if value is None:
            return False
        if self.row is not None:
            best = self.row[self.metric]
            if (value < best) if self.higher else (value > best):
                return False
        state = model.state_dict()
        tensors = {  # views, written at once: no copy of the trained values
            n: state[n].detach().cpu().numpy() for n in changed_names(model, trained) if n in state
        }
        meta = {"format": FORMAT, "row": json.dumps(row)}
        ckpt_io.write_atomic_with(self.path, lambda f: write_safetensors_to(f, tensors, meta))
        self.row = dict(row)
        return True

    def restore(self, step: int) -> None:
        """On resume: the best kept before, unless it is from past the checkpoint's step."""
        if not self.path.is_file():
            return
        row = _best_row(self.path)
        if int(row.get("step", step + 1)) <= step:
            self.row = row

    def tensors(self) -> dict[str, Array]:
        from safetensors.numpy import load_file

        return dict(load_file(str(self.path)))


def _best_row(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        row = json.loads(meta["row"])
    except Exception as exc:  # a foreign or damaged file: say which
        raise FinetuneError(f"{path} is not the best weights of a pockengine run: {exc}") from exc
    if not isinstance(row, dict):
        raise FinetuneError(f"{path}: its metadata holds no validation row")
    return row


def changed_names(model: nn.Module, trained: Iterable[str]) -> list[str]:
    """The values training changes: the trained params and every buffer (running stats;
    non-persistent ones, outside ``state_dict``, are left to the caller to skip)."""
    return sorted({*trained, *(name for name, _ in model.named_buffers())})


# -- writing RUN/model -------------------------------------------------------------------


def write_model(
    out: Path,
    task: Task,
    state: dict[str, Array],
    config: FinetuneConfig,
    best: BestWeights,
    history: list[dict[str, Any]],
    step: int,
) -> Path:
    """Load the chosen weights (``state``: the last step's, or the best kept) into
    ``task.model`` and write ``out/model``; its path. ``history``: the validation rows."""
    _load(task.model, state)
    row = history[-1] if history and history[-1].get("step") == step else {"step": step}
    keep = "last"
    if config.keep == "best" and best.row is not None and best.path.is_file():
        _load(task.model, best.tensors())
        keep, row = "best", best.row
    meta = {
        "format": FORMAT,
        "kind": task.home.get("format", "factory"),
        "task": task.kind,
        "labels": list(task.labels),
        "seq_len": config.seq_len,
        "weights": {"keep": keep, **{k: v for k, v in row.items() if k != "event"}},
        "config": config.to_dict(),
        **{k: v for k, v in task.home.items() if k not in ("format", "source")},
    }
    target = out / MODEL_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", suffix=".tmp", dir=out))
    try:
        _WRITERS[meta["kind"]](tmp, task, meta)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        _as_open_would(tmp)
        _swap(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _load(model: nn.Module, state: dict[str, Array]) -> None:
    """Copy ``state`` (``state_dict`` names; buffers the step does not hold may be left
    out) into ``model``."""
    tensors = {k: torch.from_numpy(np.array(v, order="C")) for k, v in state.items()}
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # a shape that does not fit
        raise FinetuneError(f"the trained values do not fit the model: {exc}") from exc
    if result.unexpected_keys:
        raise FinetuneError(
            f"the trained values name what the model lacks: {result.unexpected_keys}"
        )


def _as_open_would(folder: Path) -> None:
    """The permissions ``mkdir``/``open`` give (mkdtemp and the safetensors writer make
    owner-only ones)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~mask)


def _swap(tmp: Path, target: Path) -> None:
    """Put the new folder at ``target``; the old one is removed once the new one is there."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _hf_classifier(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    encoder, head = task.model.encoder, task.model.head
    assert isinstance(encoder, nn.Module) and isinstance(head, nn.Linear)
    _quiet_save(encoder, folder)
    _fill_from_source(folder / "model.safetensors", task.home.get("source"))
    task.tokenizer.save_pretrained(str(folder))
    save_file(
        {k: v.detach().contiguous() for k, v in head.state_dict().items()},
        str(folder / "head.safetensors"),
    )
    meta["head"] = "head.safetensors"
    run = folder.parent
    (folder / "README.txt").write_text(_README.format(snippet=classifier_snippet(run), run=run))


def _hf_causal_lm(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    _quiet_save(task.model, folder)
    task.tokenizer.save_pretrained(str(folder))


def _torch_module(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    """``model.safetensors`` under the module's own ``state_dict`` keys (tied tensors
    stored under each name, so ``load_state_dict(strict=True)`` takes the file as is)."""
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in task.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if isinstance(task.tokenizer, WordTokenizer):
        meta["tokenizer"] = {"kind": "words", "vocab": list(task.tokenizer.vocab)}
    elif task.tokenizer is not None:
        task.tokenizer.save_pretrained(str(folder))
        meta["tokenizer"] = {"kind": "hf"}


_WRITERS = {
    "hf-classifier": _hf_classifier,
    "hf-causal-lm": _hf_causal_lm,
    "factory": _torch_module,
    "vision": _torch_module,
}


def _quiet_save(model: nn.Module, folder: Path) -> None:
    from pockengine.finetune.models import quiet_transformers

    save: Any = model.save_pretrained  # a transformers PreTrainedModel
    with quiet_transformers():
        save(str(folder), safe_serialization=True)


def _fill_from_source(path: Path, source: str | None) -> None:
    """Add the source folder's ``pooler.*`` tensors the encoder was loaded without
    (``add_pooling_layer=False``: the classifier pools itself), unchanged, so that
    ``AutoModel.from_pretrained`` finds every weight it builds."""
    from safetensors.numpy import load_file, save_file

    files = sorted(Path(source).glob("*.safetensors")) if source else []
    saved = load_file(str(path))
    extra: dict[str, Array] = {}
    for file in files:
        for name, array in load_file(str(file)).items():
            if name.startswith("pooler.") and name not in saved:
                extra[name] = array
    if extra:
        save_file({**saved, **extra}, str(path), metadata={"format": "pt"})


def classifier_snippet(run: Path | str = "RUN") -> str:
    """Five lines of plain PyTorch + transformers that rebuild the classifier in
    ``run/model`` and classify a text (docs/finetune.md shows the same)."""
    return f'''\
import json, torch; from safetensors.torch import load_file; from transformers import AutoModel, AutoTokenizer
m = "{run}/model"; meta = json.load(open(f"{{m}}/pockengine.json")); head = load_file(f"{{m}}/head.safetensors")
encoder, tokenizer = AutoModel.from_pretrained(m).eval(), AutoTokenizer.from_pretrained(m)
x = tokenizer(["A new text"], padding="max_length", truncation=True, max_length=meta["seq_len"], return_tensors="pt")
w = x["attention_mask"].unsqueeze(-1).float(); h = (encoder(**x).last_hidden_state * w).sum(1) / w.sum(1).clamp(min=1); print(meta["labels"][int((h @ head["weight"].T + head["bias"]).argmax())])
'''  # noqa: E501


_README = """\
A text classifier fine-tuned by pockengine: this folder is the encoder as transformers
saves it (AutoModel, AutoTokenizer), plus a linear head over the mean of the last hidden
states of the unmasked tokens (head.safetensors: weight, bias) and pockengine.json (labels,
pooling, sequence length, the weights kept and the run's options).

In plain PyTorch (run from the folder that holds the run folder):

{snippet}
With pockengine: pe.load_run("{run}").predict(["A new text"]), or
pockengine predict {run} "A new text".
"""
