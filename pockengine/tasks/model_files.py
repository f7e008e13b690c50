"""Checks on a model folder before anything in it is loaded: nothing in it may execute.

A Hugging Face folder can ask for its own Python code (``auto_map`` in ``config.json``
or ``tokenizer_config.json``) and can hold pickled weights (``pytorch_model.bin``),
whose loading can run arbitrary code. PockEngine never runs either: a folder that
needs its own code is refused with what to do instead, weights load from safetensors
only, and each safetensors file is checked to be whole (a truncated download names the
file instead of failing deep inside a loader).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from pockengine.tasks.config import FinetuneError

__all__ = [
    "CONVERT_COMMAND",
    "check_model_folder",
    "check_safetensors",
    "check_tokenizer_folder",
    "has_tokenizer",
    "is_factory_spec",
    "read_json",
    "require",
]

# One command that turns a pickle-only folder into safetensors: the user runs it knowingly
# (it unpickles the weights, with torch's weights_only loader) on a folder they trust.
CONVERT_COMMAND = (
    'python -c "import sys; from transformers import AutoModel; '
    "AutoModel.from_pretrained(sys.argv[1], use_safetensors=False)"
    '.save_pretrained(sys.argv[1], safe_serialization=True)" {folder}'
)
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def read_json(
    path: Path, what: str = "JSON file", error: type[FinetuneError] = FinetuneError
) -> dict[str, Any]:
    """A JSON object from ``path``; an ``error`` (a ``FinetuneError``) naming the file,
    as a readable ``what``, otherwise."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise error(f"{path} is not a readable {what}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise error(f"{path} holds a JSON {type(loaded).__name__}, not an object")
    return loaded


def _custom_code(folder: Path) -> str | None:
    """The file asking for the folder's own code, if one does."""
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            content = read_json(path)
            if "auto_map" in content:
                return f"{path} (auto_map: {content.get('auto_map')})"
    return None


def check_model_folder(folder: Path) -> list[Path]:
    """Refuse a folder that needs its own code or has no safetensors weights; check each
    safetensors file is whole. Returns the weight files."""
    if not (folder / "config.json").is_file():
        raise FinetuneError(f"{folder} is not a Hugging Face model folder (no config.json)")
    asking = _custom_code(folder)
    if asking is not None:
        raise FinetuneError(
            f"the model in {folder} needs its own Python code ({asking}); PockEngine never "
            "runs code from a model folder. Use a folder of an architecture transformers "
            "knows, or write the model yourself and pass --model module:factory"
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise FinetuneError(
                f"{folder} holds pickled weights only ({', '.join(pickled)}); PockEngine loads "
                "safetensors only, since unpickling can run code. If you trust the folder, "
                f"convert it once with: {CONVERT_COMMAND.format(folder=folder)}"
            )
        raise FinetuneError(f"{folder} holds no model weights (no *.safetensors file)")
    for path in weights:
        check_safetensors(path)
    return weights


def check_safetensors(path: Path, data: bytes | None = None) -> None:
    """A ``FinetuneError`` naming ``path`` unless its header parses and every tensor's bytes
    lie inside the file (a truncated or corrupt file fails here, not inside a loader).
    ``data``: the file's bytes, when already read."""
    try:
        size = path.stat().st_size if data is None else len(data)
        if data is None:
            with path.open("rb") as f:
                head = f.read(8)
                data = head + f.read(min(int.from_bytes(head, "little"), size))
        length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"header length {length} does not fit a {size}-byte file")
        header = json.loads(data[8 : 8 + length])
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FinetuneError(f"{path} is not a whole safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise FinetuneError(f"{path} is not a whole safetensors file: bad header")
    held = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= held
        ):
            raise FinetuneError(
                f"{path} is truncated or corrupt: tensor {name!r} lies at {offsets}, the file "
                f"holds {held} bytes of data"
            )


def has_tokenizer(folder: Path) -> bool:
    """Whether a Hugging Face folder ships a tokenizer (vocabulary or tokenizer file)."""
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


# -- torch-free checks shared with models.py (the recipe table runs them before torch loads)


def require(module: str, install: str, purpose: str) -> None:
    """A ``FinetuneError`` with the install command when ``module`` is not importable."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        found = False
    if not found:
        raise FinetuneError(
            f"{purpose} needs the Python package {module!r}, which is not "
            f"installed; install it with: {install}"
        )


def is_factory_spec(spec: str) -> bool:
    return not Path(spec).exists() and _FACTORY.fullmatch(spec) is not None


def check_tokenizer_folder(path: str) -> Path:
    """A folder with tokenizer files that asks for none of its own code."""
    folder = Path(path)
    if not folder.is_dir():
        raise FinetuneError(f"tokenizer folder {folder} does not exist")
    config = folder / "tokenizer_config.json"
    if config.is_file() and "auto_map" in read_json(config):
        raise FinetuneError(
            f"the tokenizer in {folder} needs its own Python code ({config}: auto_map); "
            "PockEngine never runs code from a model folder"
        )
    if not has_tokenizer(folder):
        raise FinetuneError(
            f"{folder} has no tokenizer files (tokenizer.json, vocab.txt, ...); "
            "give one with --tokenizer FOLDER"
        )
    return folder
