"""Whether ``--model``/``--data`` trains a causal LM or a classifier, without torch (the
recipe table decides before torch is imported).

``--task`` when given; else a causal LM for a ``.gguf`` file or a Hugging Face folder whose
``config.json`` names a ``*ForCausalLM`` architecture, and a classifier otherwise.
"""

from __future__ import annotations

from pathlib import Path

from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.model_files import is_factory_spec, read_json

__all__ = ["architectures", "is_causal_lm_folder", "wants_lm"]


def architectures(folder: Path) -> list[str]:
    """The ``architectures`` a model folder's ``config.json`` names."""
    config = folder / "config.json"
    if not config.is_file():
        raise FinetuneError(f"{folder}: no config.json; not a Hugging Face model folder")
    names = read_json(config).get("architectures") or []
    return [str(n) for n in names] if isinstance(names, list) else []


def is_causal_lm_folder(folder: Path) -> bool:
    return any(a.endswith("ForCausalLM") for a in architectures(folder))


def wants_lm(config: FinetuneConfig) -> bool:
    """Whether the config's own model and data train a causal LM."""
    if config.recipe is not None or config.model is None:
        return False
    if config.task is not None:
        return config.task == "lm"
    if is_factory_spec(config.model):
        return False
    path = Path(config.model)
    if path.suffix.lower() == ".gguf":
        return True
    return path.is_dir() and (path / "config.json").is_file() and is_causal_lm_folder(path)
