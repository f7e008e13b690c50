"""LoRA adapters on their own, in the files Hugging Face PEFT writes and reads.

A folder holds ``adapter_model.safetensors`` (PEFT's names: ``base_model.model.<module>.
lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``) and
``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``
as the exact module paths). What else the scheme trains (a head, norms, biases: ``lora() |
head()``) is saved whole per owning module, as PEFT's ``modules_to_save`` (every param and
buffer of the module, trained or not, so the module is exactly the step's). So
``PeftModel.from_pretrained(base_model, folder)`` gives the step's function, and
``load_adapter(step, folder)`` puts a saved adapter back into a compiled step.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pockengine.ir.arrays import Array
from pockengine.safe_write import make_dirs, write_json, write_with
from pockengine.safetensors_io import write_safetensors_to
from pockengine.sparse.lora import Adapter, merge_adapters
from pockengine.step.running import CompiledStep
from pockengine.step.strict_load import LoadResult, StateError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "changed_in_model",
    "load_adapter",
    "merged_state",
    "save_adapter",
]

ADAPTER_DIR = "adapter"  # RUN/adapter/ of a fine-tuning run with LoRA
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def save_adapter(
    step: CompiledStep, folder: str | Path, *, base_model: str | None = None
) -> Path | None:
    """Write ``step``'s adapters (and the modules it trains besides) into ``folder``;
    None, writing nothing, when the step has no LoRA adapter."""
    adapters = step.resolution.adapters
    if not adapters:
        return None
    folder = make_dirs(Path(folder), inside=Path(folder).parent)
    modules = _modules_to_save(step)
    factors = [n for a in adapters for n in (a.a_name, a.b_name)]
    saved = [*factors, *(n for n in step.state_names if _module_of(n) in modules)]
    state = step.flat_state_dict(saved)  # not the frozen (maybe quantized) weights
    tensors = {PEFT_PREFIX + n: state[n] for n in factors}
    for name, value in state.items():
        if _module_of(name) in modules:
            tensors[PEFT_PREFIX + name] = value
    write_with(folder / ADAPTER_WEIGHTS, lambda f: write_safetensors_to(f, tensors), folder)
    write_json(folder / ADAPTER_CONFIG, _peft_config(adapters, sorted(modules), base_model), folder)
    return folder


def load_adapter(step: CompiledStep, folder: str | Path) -> LoadResult:
    """Load a saved adapter (this module's or PEFT's files) into ``step``: every adapter of
    the step must be there with its shape; nothing is written otherwise. Returns what the
    files left out (the step's params outside the adapter keep their values)."""
    folder = Path(folder)
    config = _read_config(folder / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise StateError(
            f"{folder / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}, not 'LORA'"
        )
    arrays = _read_safetensors(folder / ADAPTER_WEIGHTS)
    bare = {k.removeprefix(PEFT_PREFIX): v for k, v in arrays.items()}
    bare = {_without_adapter_name(k): v for k, v in bare.items()}
    wanted = {n for a in step.resolution.adapters for n in (a.a_name, a.b_name)}
    absent = sorted(wanted - set(bare))
    if absent:
        raise StateError(
            f"{folder}: the adapter lacks {len(absent)} of the step's LoRA "
            f"factors ({', '.join(absent[:5])}); nothing was loaded"
        )
    result = step.load_state(bare, strict=False)
    if result.unexpected or result.mismatched:
        raise StateError(f"{folder} does not fit the step: {result.describe()}")
    return result


def merged_state(step: CompiledStep) -> dict[str, Array]:
    """The step's params and buffers under the plain model's names, each adapter folded into
    the weight it adapts (what ``RUN/model`` holds: a model with no adapter)."""
    return merge_adapters(step.flat_state_dict(), step.resolution.adapters)


def changed_in_model(step: CompiledStep) -> tuple[str, ...]:
    """The plain model's names that training changes: the trained params, with each LoRA
    pair standing for the weight it is merged into."""
    factors = {n for a in step.resolution.adapters for n in (a.a_name, a.b_name)}
    adapted = tuple(a.weight for a in step.resolution.adapters)
    return (*(n for n in step.trained if n not in factors), *adapted)


def _modules_to_save(step: CompiledStep) -> set[str]:
    """The modules owning a trained param that is not a LoRA factor."""
    factors = {n for a in step.resolution.adapters for n in (a.a_name, a.b_name)}
    return {step.info.param(n).module for n in step.resolution.rows if n not in factors}


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _without_adapter_name(key: str) -> str:
    """PEFT's in-memory names carry the adapter name (``lora_A.default.weight``); its
    files do not. Accept both."""
    for part in ("lora_A", "lora_B"):
        head, sep, tail = key.partition(f".{part}.")
        if sep and tail.count(".") == 1:
            return f"{head}.{part}.{tail.split('.')[-1]}"
    return key


def _peft_config(
    adapters: tuple[Adapter, ...], modules_to_save: list[str], base_model: str | None
) -> dict[str, Any]:
    """A LoraConfig PEFT reads: the common rank/alpha, patterns for the others."""
    rank = Counter(a.rank for a in adapters).most_common(1)[0][0]
    alpha = Counter(a.alpha for a in adapters).most_common(1)[0][0]
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "rank_pattern": {a.module: a.rank for a in adapters if a.rank != rank},
        "alpha_pattern": {a.module: a.alpha for a in adapters if a.alpha != alpha},
        "target_modules": sorted(a.module for a in adapters),
        "modules_to_save": modules_to_save or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateError(f"cannot read the adapter config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise StateError(f"{path} must hold a JSON object")
    return data


def _read_safetensors(path: Path) -> dict[str, Array]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return dict(load_file(str(path)))
    except (OSError, SafetensorError) as exc:
        raise StateError(f"cannot read the adapter weights {path}: {exc}") from exc
