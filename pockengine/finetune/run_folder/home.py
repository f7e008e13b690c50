"""The run's model in its home format: ``RUN/model/``, and the best weights kept for it.

At each validation ``BestWeights.offer`` (``finetune/run_folder/best.py``) keeps the weights of the
best validation so far (ties: the latest): only the values training changes (the trained
params and the model's buffers), read from the step (``released.step_values``), written
atomically to ``RUN/best.safetensors`` so that ``--resume`` keeps them too. At the end of
an invocation ``write_model`` loads the last (``--keep last``) or the best weights into the
task's torch model, one tensor at a time, and writes it where it came from, by the recipe's
``Task.home``:

- ``hf-classifier``: the encoder as ``save_pretrained`` writes it (config,
  ``model.safetensors``, tokenizer files), the linear head in ``head.safetensors``
  (``weight``, ``bias``), pooling, labels and sequence length in ``pockengine.json``;
- ``hf-causal-lm``: the whole ``save_pretrained`` folder (``AutoModelForCausalLM`` loads it);
- ``factory`` and ``vision``: ``model.safetensors`` under the model's own ``state_dict``
  keys, and in ``pockengine.json`` how to rebuild the module (the factory and its
  arguments; the builder and the image preprocessing), the word vocabulary if any.

Names need no table: ``TrainStep.flat_state_dict`` already gives the values under the
torch model's ``state_dict`` names (the frontend's record of each param and buffer), so
the values are loaded into the model and written from it. Where the model's float copies
of quantized weights were released (``released.release_held``), the same files are
streamed from the step instead, tensor by tensor (``STREAMED``): the config files as
``save_pretrained`` writes them, then ``model.safetensors`` header first and each value as
it is read (a quantized weight dequantized then). The folder is written beside
``RUN/model`` and renamed into place, so it is never half written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.finetune.run_folder.best import BEST, FORMAT, BestWeights
from pockengine.finetune.run_folder.released import is_released, write_streamed
from pockengine.ir.arrays import Array
from pockengine.out_folder import RUN, install_folder, kind_of
from pockengine.safe_write import write_json, write_text
from pockengine.safetensors_io import append_tensors
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.data import WordTokenizer
from pockengine.tasks.recipes import Task

__all__ = [
    "BEST",
    "FORMAT",
    "META",
    "MODEL_DIR",
    "STREAMED",
    "WRITERS",
    "BestWeights",
    "chosen_weights",
    "classifier_readme",
    "classifier_snippet",
    "install",
    "model_meta",
    "write_model",
]

MODEL_DIR = "model"
META = "pockengine.json"


def changed_names(buffers: Iterable[str], trained: Iterable[str]) -> list[str]:
    """The values training changes: the trained params and every buffer of the model
    (running stats; non-persistent ones, outside ``state_dict``, are left to the caller to
    skip)."""
    return sorted({*trained, *buffers})


# -- writing RUN/model -------------------------------------------------------------------


def write_model(
    out: Path,
    task: Task,
    state: Mapping[str, Array],
    config: FinetuneConfig,
    best: BestWeights,
    history: list[dict[str, Any]],
    step: int,
    changed: Iterable[str] | None = None,
) -> Path:
    """Write ``out/model`` from the chosen weights (``state``: the last step's, by model
    name, read one at a time; or the best kept, over them); its path. ``history``: the
    validation rows. The values are loaded into ``task.model`` (only ``changed`` ones when
    given: the others are the model's own, and copying them onto themselves would turn
    memory-mapped weights into private memory) and written from it, or,
    where the model's float copies of quantized weights were released, streamed to the
    files tensor by tensor (``released.write_streamed``)."""
    state, best_names, keep, row = chosen_weights(state, config, best, history, step)
    streamed = is_released(task.model)
    if not streamed:
        names = state.keys() if changed is None else {*changed, *best_names}
        _load(task.model, {n: state[n] for n in names if n in state})
    meta = model_meta(task.home, task.kind, task.labels, config, keep, row)

    def fill(tmp: Path) -> None:
        if streamed:
            STREAMED[meta["kind"]](tmp, task, meta, state)
        else:
            WRITERS[meta["kind"]](tmp, task, meta)

    return install(out, meta, fill)


def chosen_weights(
    state: Mapping[str, Array],
    config: FinetuneConfig,
    best: BestWeights,
    history: list[dict[str, Any]],
    step: int,
) -> tuple[Mapping[str, Array], set[str], str, dict[str, Any]]:
    """The weights ``RUN/model`` holds (``--keep``: the last step's ``state``, or the best
    kept over them), the names the best weights replaced, "last"/"best", and the
    validation row they scored."""
    row = history[-1] if history and history[-1].get("step") == step else {"step": step}
    if config.keep == "best" and best.row is not None and best.path.is_file():
        kept = best.tensors()
        return _Overlay(state, kept), set(kept), "best", best.row
    return state, set(), "last", row


def model_meta(
    home: Mapping[str, Any],
    kind: str,
    labels: Iterable[str],
    config: FinetuneConfig,
    keep: str,
    row: Mapping[str, Any],
) -> dict[str, Any]:
    """``pockengine.json`` of ``RUN/model`` (the writers add what their format needs)."""
    return {
        "format": FORMAT,
        "kind": home.get("format", "factory"),
        "task": kind,
        "labels": list(labels),
        "seq_len": config.seq_len,
        "weights": {"keep": keep, **{k: v for k, v in row.items() if k != "event"}},
        "config": config.to_dict(),
        **{k: v for k, v in home.items() if k not in ("format", "source")},
    }


def install(out: Path, meta: dict[str, Any], fill: Callable[[Path], None]) -> Path:
    """``out/model``: ``fill(folder)`` writes the files into a folder beside it, then
    ``META`` (``meta``, as ``fill`` left it) is added and the folder put in place
    (``out_folder.install_folder``: whole in a run folder of ours; file by file, keeping
    what else is there, in a folder taken with ``--force``)."""
    target = out / MODEL_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", suffix=".tmp", dir=out))
    try:
        fill(tmp)
        write_json(tmp / META, meta, inside=tmp)
        _as_open_would(tmp)
        install_folder(tmp, target, merge=kind_of(out) != RUN)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class _Overlay(Mapping[str, Array]):
    """``base`` with some values replaced (the best weights kept, over the last ones)."""

    def __init__(self, base: Mapping[str, Array], over: Mapping[str, Array]) -> None:
        self.base, self.over = base, over

    def __getitem__(self, name: str) -> Array:
        return self.over[name] if name in self.over else self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        yield from (k for k in self.over if k not in self.base)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _load(model: nn.Module, state: Mapping[str, Array]) -> None:
    """Copy ``state`` (``state_dict`` names; buffers the step does not hold may be left
    out) into ``model``, one tensor at a time."""
    targets = model.state_dict()  # detached tensors over the model's own memory
    unexpected = sorted(k for k in state if k not in targets)
    if unexpected:
        raise FinetuneError(f"the trained values name what the model lacks: {unexpected}")
    with torch.no_grad():
        for name, target in targets.items():
            if name not in state:
                continue
            value = torch.from_numpy(np.array(state[name], order="C"))  # one tensor at a time
            if value.shape != target.shape:
                shapes = f"{list(value.shape)}, the model's {list(target.shape)}"
                raise FinetuneError(f"the trained values do not fit the model: {name} is {shapes}")
            target.copy_(value)


def _as_open_would(folder: Path) -> None:
    """The permissions ``mkdir``/``open`` give (mkdtemp and the safetensors writer make
    owner-only ones)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~mask)


def _hf_classifier(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    encoder, head = task.model.encoder, task.model.head
    assert isinstance(encoder, nn.Module) and isinstance(head, nn.Linear)
    _quiet_save(encoder, folder)
    save_file(
        {k: v.detach().contiguous() for k, v in head.state_dict().items()},
        str(folder / "head.safetensors"),
    )
    _classifier_files(folder, task, meta)


def _classifier_files(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    """What a classifier folder holds beside its weights."""
    _fill_from_source(folder / "model.safetensors", task.home.get("source"))
    task.tokenizer.save_pretrained(str(folder))
    meta["head"] = "head.safetensors"
    write_text(folder / "README.txt", classifier_readme(folder.parent), inside=folder)


def _hf_causal_lm(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    _quiet_save(task.model, folder)
    task.tokenizer.save_pretrained(str(folder))


def _torch_module(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    """``model.safetensors`` under the module's own ``state_dict`` keys (tied tensors
    stored under each name, so ``load_state_dict(strict=True)`` takes the file as is)."""
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in task.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _module_tokenizer(folder, task, meta)


def _module_tokenizer(folder: Path, task: Task, meta: dict[str, Any]) -> None:
    if isinstance(task.tokenizer, WordTokenizer):
        meta["tokenizer"] = {"kind": "words", "vocab": list(task.tokenizer.vocab)}
    elif task.tokenizer is not None:
        task.tokenizer.save_pretrained(str(folder))
        meta["tokenizer"] = {"kind": "hf"}


WRITERS = {
    "hf-classifier": _hf_classifier,
    "hf-causal-lm": _hf_causal_lm,
    "factory": _torch_module,
    "vision": _torch_module,
}


# -- streamed from the step (the model's float copies of quantized weights released) ------


def _stream_hf(folder: Path, model: nn.Module, state: Mapping[str, Array], prefix: str) -> None:
    """What ``save_pretrained`` writes (config, generation config, ``model.safetensors``
    with each tied tensor once), the weights read from ``state`` one at a time."""
    config: Any = model.config  # a transformers PreTrainedModel
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(folder))
    generation: Any = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(str(folder))
    write_streamed(
        folder / "model.safetensors",
        model,
        lambda n: state.get(prefix + n),
        each_tensor_once=True,
        metadata={"format": "pt"},
    )


def _streamed_causal_lm(
    folder: Path, task: Task, meta: dict[str, Any], state: Mapping[str, Array]
) -> None:
    _stream_hf(folder, task.model, state, "")
    task.tokenizer.save_pretrained(str(folder))


def _streamed_classifier(
    folder: Path, task: Task, meta: dict[str, Any], state: Mapping[str, Array]
) -> None:
    encoder, head = task.model.encoder, task.model.head
    assert isinstance(encoder, nn.Module) and isinstance(head, nn.Module)
    _stream_hf(folder, encoder, state, "encoder.")
    write_streamed(folder / "head.safetensors", head, lambda n: state.get("head." + n))
    _classifier_files(folder, task, meta)


def _streamed_module(
    folder: Path, task: Task, meta: dict[str, Any], state: Mapping[str, Array]
) -> None:
    write_streamed(folder / "model.safetensors", task.model, state.get, metadata={"format": "pt"})
    _module_tokenizer(folder, task, meta)


STREAMED = {
    "hf-classifier": _streamed_classifier,
    "hf-causal-lm": _streamed_causal_lm,
    "factory": _streamed_module,
    "vision": _streamed_module,
}


def _quiet_save(model: nn.Module, folder: Path) -> None:
    from pockengine.tasks.models import quiet_transformers

    save: Any = model.save_pretrained  # a transformers PreTrainedModel
    with quiet_transformers():
        save(str(folder), safe_serialization=True)


def _fill_from_source(path: Path, source: str | None) -> None:
    """Add the source folder's ``pooler.*`` tensors the encoder was loaded without
    (``add_pooling_layer=False``: the classifier pools itself), unchanged, so that
    ``AutoModel.from_pretrained`` finds every weight it builds. Only those tensors are
    read; the written file's data are copied through, not loaded."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        have = set(f.keys())
    extra: dict[str, Array] = {}
    for file in sorted(Path(source).glob("*.safetensors")) if source else []:
        with safe_open(str(file), "np") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle: not iterable)
                if name.startswith("pooler.") and name not in have:
                    extra[name] = f.get_tensor(name)
    if extra:
        append_tensors(path, extra)


def classifier_readme(run: Path) -> str:
    """``README.txt`` of a classifier's ``RUN/model`` (``run``: the run folder)."""
    return _README.format(snippet=classifier_snippet(run), run=run)


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
