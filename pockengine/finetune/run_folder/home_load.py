"""``pe.load_run(RUN)``: the run's model back from ``RUN/model``, ready to predict.

Only ``RUN/model`` is read (the training data need not be present). Nothing in the folder
executes and nothing in it names code to run: ``pockengine.json`` is checked first
(``run_meta.read_model_meta``); transformers loads the folder offline from safetensors with
no code of its own (``models.load_hf_encoder``); a ``module:factory`` model is rebuilt by
the factory the user names again (``factory=``, ``--factory``), which must be the one the
run recorded (``run_meta.named_factory``), and its weights are loaded strictly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.finetune.run_folder.home import META, MODEL_DIR
from pockengine.finetune.run_folder.run_meta import named_factory, names_factory, read_model_meta
from pockengine.ir.arrays import Array
from pockengine.tasks import models
from pockengine.tasks.config import FinetuneError
from pockengine.tasks.data import WordTokenizer, encode_hf
from pockengine.tasks.model_files import check_model_folder, check_safetensors

__all__ = ["LoadedRun", "load_run"]


@dataclass
class LoadedRun:
    """A fine-tuned model: ``model`` (eval mode), ``tokenizer``, ``labels`` and ``meta``
    (``RUN/model/pockengine.json``: the run's options, the weights kept, preprocessing);
    ``factory``: the ``module:factory`` the user named to load it (None for other runs)."""

    path: Path
    model: nn.Module
    tokenizer: Any
    labels: tuple[str, ...]
    meta: dict[str, Any] = field(repr=False)
    factory: str | None = None

    @property
    def kind(self) -> str:
        """``hf-classifier``, ``hf-causal-lm``, ``factory`` or ``vision``."""
        return str(self.meta["kind"])

    @property
    def is_causal_lm(self) -> bool:
        return self.meta.get("task") == "causal-lm"

    def encode(self, texts: Sequence[str]) -> tuple[Array, ...]:
        """Model inputs for ``texts``, exactly as the run encoded its training data."""
        seq_len = int(self.meta["seq_len"])
        if isinstance(self.tokenizer, WordTokenizer):
            return self.tokenizer.encode(texts, seq_len)
        return encode_hf(self.tokenizer, texts, seq_len)

    def logits(
        self,
        inputs: Sequence[Any],
        batch_size: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The model's logits for ``inputs`` (texts, or images for a vision run)."""
        self._need_labels()
        outs = []
        for start in range(0, len(inputs), batch_size):
            chunk = inputs[start : start + batch_size]
            arrays = self.encode(chunk) if self.kind != "vision" else (self._images(chunk),)
            with torch.no_grad():
                outs.append(self.model(*(torch.from_numpy(a) for a in arrays)))
            if progress is not None:
                progress(len(chunk))
        return torch.cat(outs) if outs else torch.zeros(0, len(self.labels))

    def predict_proba(self, inputs: Sequence[Any], batch_size: int = 32) -> Array:
        """Class probabilities, ``[len(inputs), len(labels)]``."""
        probs: Array = torch.softmax(self.logits(inputs, batch_size), -1).numpy()
        return probs

    def predict(self, inputs: Sequence[Any], batch_size: int = 32) -> list[dict[str, Any]]:
        """``{"label": ..., "probs": {label: p, ...}}`` for each text (or image: an array
        of grey pixels or an image file path, for a vision run)."""
        if isinstance(inputs, str):
            inputs = [inputs]
        return [as_prediction(row, self.labels) for row in self.predict_proba(inputs, batch_size)]

    def _need_labels(self) -> None:
        if self.is_causal_lm:
            raise FinetuneError(
                f"{self.path} is a causal language model: it generates text "
                "(pockengine generate RUN --prompt TEXT) rather than predicting labels"
            )

    def _images(self, items: Sequence[Any]) -> Array:
        from pockengine.tasks import vision

        size = int(self.meta["preprocessing"]["resize"]["size"][0])
        return vision.preprocess(np.stack([_grey28(item) for item in items]), size)


def as_prediction(probs: Array, labels: Sequence[str]) -> dict[str, Any]:
    """One prediction line: the most probable label and every label's probability."""
    return {
        "label": labels[int(np.argmax(probs))],
        "probs": {name: round(float(p), 6) for name, p in zip(labels, probs, strict=True)},
    }


def _grey28(item: Any) -> Array:
    """An image as Fashion-MNIST holds one: uint8 grey 28x28 (a file is converted)."""
    if isinstance(item, str | Path):
        from PIL import Image

        with Image.open(item) as image:
            item = np.asarray(image.convert("L").resize((28, 28), Image.Resampling.BILINEAR))
    array = np.asarray(item)
    if array.shape != (28, 28):
        raise FinetuneError(f"an image of shape {list(array.shape)}; expected 28x28 grey pixels")
    return array.astype(np.uint8)


def load_run(run: str | Path, factory: str | None = None) -> LoadedRun:
    """The model of a ``pockengine finetune`` run folder (``RUN/model``), in eval mode.

    ``factory``: for a run of a ``module:factory`` model, the factory to rebuild it with,
    named by the caller (the one the run recorded; the folder's record alone is never
    imported). Other runs take none."""
    folder = Path(run) / MODEL_DIR
    meta_path = folder / META
    if not meta_path.is_file():
        raise FinetuneError(
            f"{run} holds no fine-tuned model ({meta_path} is missing): pockengine finetune "
            "writes RUN/model/ when a run ends or stops"
        )
    meta = read_model_meta(meta_path)
    recorded = meta["factory"] if meta["kind"] == "factory" else None
    factory = named_factory(recorded, factory, meta_path)
    stored = (meta.get("config") or {}).get("model")
    if names_factory(stored) and stored != factory:  # evaluate rebuilds from the options
        named_factory(stored, factory, meta_path)
    model, tokenizer = _LOADERS[str(meta["kind"])](folder, {**meta, "factory": factory})
    model.eval()
    labels = tuple(meta["labels"])
    return LoadedRun(Path(run), model, tokenizer, labels, meta, factory)


def _hf_classifier(folder: Path, meta: dict[str, Any]) -> tuple[nn.Module, Any]:
    from safetensors.torch import load_file

    encoder, hidden, _ = models.load_hf_encoder(str(folder))
    check_safetensors(folder / "head.safetensors")
    model = models.MeanPoolClassifier(encoder, hidden, len(meta["labels"]))
    _strict(model.head, load_file(str(folder / "head.safetensors")), folder / "head.safetensors")
    return model, models.load_hf_tokenizer(str(folder))


def _hf_causal_lm(folder: Path, meta: dict[str, Any]) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM

    check_model_folder(folder)
    try:
        with models.quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(folder),
                dtype=torch.float32,
                use_safetensors=True,
                local_files_only=True,
                trust_remote_code=False,
            )
    except Exception as exc:  # transformers raises many kinds; the folder is the cause
        raise FinetuneError(f"cannot load the causal LM in {folder}: {exc}") from exc
    return model, models.load_hf_tokenizer(str(folder))


def _torch_module(folder: Path, meta: dict[str, Any]) -> tuple[nn.Module, Any]:
    from safetensors.torch import load_file

    if meta["kind"] == "vision":
        from pockengine.tasks import vision

        model = vision.lite0(int(meta["classes"]))
    else:
        model = models.load_factory(str(meta["factory"]), **meta["factory_kwargs"])  # user-named
    path = folder / "model.safetensors"
    check_safetensors(path)
    _strict(model, load_file(str(path)), path)
    return model, _tokenizer(folder, meta.get("tokenizer"))


def _tokenizer(folder: Path, spec: dict[str, Any] | None) -> Any:
    if spec is None:
        return None
    if spec.get("kind") == "words":
        return WordTokenizer(spec["vocab"])
    return models.load_hf_tokenizer(str(folder))


def _strict(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # torch's report of missing/unexpected/mismatched keys
        raise FinetuneError(f"{path} does not fit the model: {exc}") from exc


_LOADERS: dict[str, Callable[[Path, dict[str, Any]], tuple[nn.Module, Any]]] = {
    "hf-classifier": _hf_classifier,
    "hf-causal-lm": _hf_causal_lm,
    "factory": _torch_module,
    "vision": _torch_module,
}
