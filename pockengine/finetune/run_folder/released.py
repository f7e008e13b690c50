"""The torch model after compiling: float copies of quantized weights released, and the
step as the source of every value.

Once the step holds a frozen weight as low-bit codes (``--frozen-dtype``, GGUF blocks), or
holds its own copy of a trained param, and evaluation runs through the compiled forward,
the torch model's float copy of that weight is read by nothing: ``release_held`` replaces
it with a parameter on the ``meta`` device (same shape and dtype, no storage; tied names
keep sharing one). What still needs
the values reads them from the step, one tensor at a time: ``StepValues`` (a lazy mapping
by model name; a quantized weight is dequantized when it is read) and
``write_streamed``, which writes a safetensors file header first, then each tensor as it
is read, so writing ``RUN/model`` never holds the whole float model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pockengine.finetune.run_folder.adapter import merged_state
from pockengine.ir.arrays import Array
from pockengine.safetensors_io import write_streamed_to
from pockengine.step.compiler import TrainStep
from pockengine.step.running import CompiledStep
from pockengine.tasks.config import FinetuneError

__all__ = [
    "StepValues",
    "is_released",
    "quantized_names",
    "quantized_stand_ins",
    "release_held",
    "stand_in",
    "step_values",
    "write_streamed",
]


class StepValues(Mapping[str, Array]):
    """The step's params and persistent buffers by model name (tied tensors under each of
    their names), each read from the step when it is looked up (a fresh array; with
    ``copy=False`` the backend's own memory where it lends it, valid until the next step:
    for a writer, which then holds no copy)."""

    def __init__(self, step: CompiledStep, copy: bool = True) -> None:
        self._step, self._copy = step, copy
        self._names = tuple(step.state_specs())

    def __getitem__(self, name: str) -> Array:
        return self._step.value(name, copy=self._copy)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def step_values(step: CompiledStep, copy: bool = True) -> Mapping[str, Array]:
    """What ``RUN/model`` and the best weights are made of: the step's values, lazily; with
    LoRA adapters, merged into the weights they adapt (read whole, as the merge needs).
    ``copy=False``: lent where the backend can (``StepValues``), for a writer."""
    return merged_state(step) if step.resolution.adapters else StepValues(step, copy)


def quantized_names(step: TrainStep) -> list[str]:
    """The model names of the weights ``step`` stores quantized."""
    return list(step.quantized)


def quantized_stand_ins(step: TrainStep) -> dict[str, Array]:
    """Broadcast zeros (no memory) of the float shape and dtype of each weight ``step``
    stores quantized, under each of its model names."""
    specs = step.state_specs()
    out = {}
    for name in step.quantized:
        shape, dtype = specs[name]
        zero = np.broadcast_to(np.zeros((), dtype), shape)
        out.update(dict.fromkeys(step.aliases(name), zero))
    return out


def release_held(model: nn.Module, step: TrainStep, also: Iterable[str] = ()) -> int:
    """Replace the float copies of the weights ``step`` stores quantized, and of the params
    named in ``also`` (model names: e.g. ``step.trained``, which the step holds its own
    copies of), with storage-less ``meta`` parameters; the bytes released."""
    released = 0
    for name in dict.fromkeys([*quantized_names(step), *also]):
        names = step.aliases(name)
        old = model.get_parameter(names[0])
        if old.device.type == "meta":
            continue
        empty = nn.Parameter(
            torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False
        )
        for alias in names:
            module, _, local = alias.rpartition(".")
            setattr(model.get_submodule(module), local, empty)
        released += old.numel() * old.element_size()
    return released


def stand_in(model: nn.Module, names: Iterable[str]) -> int:
    """Replace the params ``names`` (model names; a tied param under all of its names)
    with stand-ins of the same shape and dtype that hold one zero, broadcast: for weights
    the step takes from elsewhere (the GGUF blocks of ``--frozen-dtype gguf``), so tracing
    and compiling never hold their float values, which nothing reads (``quantize_frozen``
    takes the blocks as given). Unlike a ``meta`` param, a stand-in is on the model's
    device: torch.export traces it with the rest. Returns the bytes released."""
    wanted = set(names)
    named = list(model.named_parameters(remove_duplicate=False))
    stand_ins: dict[int, nn.Parameter] = {}  # one per param: tied names stay tied
    released = 0
    for name, param in named:
        if name in wanted and id(param) not in stand_ins:
            zero = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
            stand_ins[id(param)] = nn.Parameter(zero, requires_grad=False)
            released += param.numel() * param.element_size()
    for name, param in named:
        if id(param) in stand_ins:
            module, _, local = name.rpartition(".")
            setattr(model.get_submodule(module), local, stand_ins[id(param)])
    return released


def is_released(model: nn.Module) -> bool:
    """Whether some of ``model``'s params have no storage (``release_held``)."""
    return any(p.device.type == "meta" for p in model.parameters())


def write_streamed(
    path: Path,
    module: nn.Module,
    read: Callable[[str], Array | None],
    *,
    each_tensor_once: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """``module``'s ``state_dict`` as a safetensors file, each value ``read(name)`` (None:
    the module's own, which must have storage) written as soon as it is read.
    ``each_tensor_once``: a tensor under several names (tied weights) is written under the
    first only, as ``save_pretrained`` does."""
    state = module.state_dict(keep_vars=True)  # tied names: one object, seen once below
    if each_tensor_once:
        firsts: dict[int, str] = {}
        state = {k: v for k, v in state.items() if firsts.setdefault(id(v), k) == k}
    specs = {
        k: np.broadcast_to(np.zeros((), _numpy_dtype(v.dtype)), tuple(v.shape))
        for k, v in state.items()
    }
    with path.open("wb") as f:
        write_streamed_to(f, specs, lambda n: _value(n, state[n], read(n), specs[n]), metadata)


def _value(name: str, tensor: torch.Tensor, given: Array | None, spec: Array) -> Array:
    if given is None:
        if tensor.device.type == "meta":
            raise FinetuneError(f"{name}: the model's copy was released and the step has none")
        given = tensor.detach().cpu().numpy()  # a buffer or param the step does not hold
    if given.shape != spec.shape:
        raise FinetuneError(
            f"the trained values do not fit the model: {name} is "
            f"{list(given.shape)}, the model's {list(spec.shape)}"
        )
    return np.asarray(given, dtype=spec.dtype)  # cast if need be, not copied otherwise


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)
