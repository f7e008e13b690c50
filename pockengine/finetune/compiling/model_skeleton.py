"""``RUN/model`` written by a process that has no torch model (``--compile-in child``).

The process that builds the model and compiles the step also writes the model folder
once, as the run would (``home.WRITERS``: ``save_pretrained``, the tokenizer, the
classifier's head file and README), from the model's initial values: the *skeleton*, with
``skeleton.json`` saying which ``pockengine.json`` entries the writer added and which
state-name prefix each weights file's tensors carry (the classifier's encoder is
``encoder.`` in the step). At the end of the run the training process copies the
skeleton into ``RUN/model`` and rewrites each weights file from the step's values
(``write_from_skeleton``): the header is kept byte for byte (same names, dtypes, shapes,
offsets), and each tensor is the step's value of that name, cast to the file's dtype,
read and written one at a time, or, for a tensor the step does not hold (a pooler the
classifier never reads, a buffer outside the step), the skeleton's own bytes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from pockengine.finetune.run_folder import home
from pockengine.finetune.run_folder.released import is_released
from pockengine.ir.arrays import Array
from pockengine.safe_write import write_text
from pockengine.safetensors_io import SAFETENSORS_DTYPES, read_header
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.recipes import Task

__all__ = ["SKELETON", "write_from_skeleton", "write_skeleton"]
SKELETON = "skeleton.json"
_PREFIXES = {"hf-classifier": {"model.safetensors": "encoder.", "head.safetensors": "head."}}
_CHUNK = 8 << 20


def write_skeleton(
    folder: Path, task: Task, state: Mapping[str, Array], zeroed: Mapping[str, Array] | None = None
) -> None:
    """``RUN/model`` as ``home.write_model`` writes it from ``task.model`` as it is (or,
    where its copies of the step's weights were released, streamed from ``state``, the
    step's values), plus ``SKELETON``: the writer's additions to ``pockengine.json`` and
    the weights files. The tensors in ``zeroed`` (model names -> broadcast zeros of their
    shape: ``released.quantized_stand_ins``, the weights the step stores quantized, whose
    values the step's own always replace) are written as zeros, never dequantized whole;
    ``refill`` refuses to keep those bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    kind = task.home.get("format", "factory")
    added: dict[str, Any] = {}
    zeroed = dict(zeroed or {})
    # Streamed tensor by tensor (from the step's values, else the module's own) whether or
    # not the model's copies were released: ``save_pretrained`` would build the whole file
    # in memory, and read every memory-mapped weight at once.
    if not is_released(task.model):
        zeroed = {}
    home.STREAMED[kind](folder, task, added, _Zeroed(state, zeroed))
    prefixes = _PREFIXES.get(kind, {})
    files = {p.name: prefixes.get(p.name, "") for p in sorted(folder.glob("*.safetensors"))}
    spec = {"kind": kind, "meta": added, "files": files, "zeroed": sorted(zeroed)}
    (folder / SKELETON).write_text(json.dumps(spec, indent=1) + "\n")


def write_from_skeleton(
    out: Path,
    skeleton: Path,
    task: Task,
    state: Mapping[str, Array],
    config: FinetuneConfig,
    best: home.BestWeights,
    history: list[dict[str, Any]],
    step: int,
) -> Path:
    """``out/model`` from ``skeleton`` with the chosen weights (``home.chosen_weights``:
    ``state``, the step's values by model name, or the best kept over them)."""
    spec = json.loads((skeleton / SKELETON).read_text())
    state, _, keep, row = home.chosen_weights(state, config, best, history, step)
    meta = home.model_meta(task.home, task.kind, task.labels, config, keep, row)
    meta.update(spec["meta"])
    files: dict[str, str] = spec["files"]

    def fill(folder: Path) -> None:
        for path in sorted(skeleton.iterdir()):
            if path.name == SKELETON:
                continue
            if path.name in files:
                prefix = files[path.name]
                zeroed = {n[len(prefix) :] for n in spec.get("zeroed", []) if n.startswith(prefix)}
                refill(path, folder / path.name, _reader(state, prefix), zeroed)
            else:
                shutil.copy(path, folder / path.name)
        if spec["kind"] == "hf-classifier":  # it names the run folder
            write_text(folder / "README.txt", home.classifier_readme(out), inside=folder)

    return home.install(out, meta, fill)


class _Zeroed(Mapping[str, Array]):
    """``state`` with the names in ``zeroed`` read as their (broadcast zero) stand-ins."""

    def __init__(self, state: Mapping[str, Array], zeroed: Mapping[str, Array]) -> None:
        self._state, self._zeroed = state, zeroed

    def __getitem__(self, name: str) -> Array:
        zero = self._zeroed.get(name)
        return self._state[name] if zero is None else zero

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def _reader(state: Mapping[str, Array], prefix: str) -> Callable[[str], Array | None]:
    return lambda name: state.get(prefix + name)


def refill(
    src: Path, dst: Path, read: Callable[[str], Array | None], zeroed: Collection[str] = ()
) -> None:
    """``src`` (a safetensors file) as ``dst``, each tensor ``read(name)`` where that is
    not None (cast to the file's dtype, checked for shape), else ``src``'s own bytes,
    which for a name in ``zeroed`` (``write_skeleton``) are no values: an error."""
    with src.open("rb") as f, dst.open("wb") as out:
        head, header = read_header(f)
        size = len(head)
        header.pop("__metadata__", None)
        out.write(size.to_bytes(8, "little") + head)
        at = 0
        for name, entry in sorted(header.items(), key=lambda e: int(e[1]["data_offsets"][0])):
            start, stop = (int(x) for x in entry["data_offsets"])
            if start != at:
                raise FinetuneError(f"{src}: {name} does not follow the tensor before it")
            value = read(name)
            if value is None and name in zeroed:
                raise FinetuneError(
                    f"{src}: {name} holds zeros in place of a weight the step "
                    "stored quantized, and the step gave no value"
                )
            if value is None:
                f.seek(8 + size + start)
                _copy(f, out, stop - start)
            else:
                out.write(_cast(src, name, entry, value).reshape(-1).view(np.uint8).data)
            at = stop


def _cast(src: Path, name: str, entry: Mapping[str, Any], value: Array) -> Array:
    shape = tuple(int(d) for d in entry["shape"])
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise FinetuneError(f"{src}: {name} is {entry['dtype']}, which NumPy cannot write")
    if value.shape != shape:
        raise FinetuneError(
            f"the trained values do not fit the model: {name} is "
            f"{list(value.shape)}, the model's {list(shape)}"
        )
    return np.asarray(value, dtype=dtype, order="C")


def _copy(src: IO[bytes], dst: IO[bytes], count: int) -> None:
    while count:
        chunk = src.read(min(count, _CHUNK))
        if not chunk:
            raise FinetuneError(f"{getattr(src, 'name', 'a skeleton file')} is cut short")
        dst.write(chunk)
        count -= len(chunk)
