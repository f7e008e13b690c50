"""``pe.compile(..., in_place=True)``: the step trains the torch module's own tensors.

By default a step owns every value it writes: it copies the trained params (and the
buffers it updates, BatchNorm's running statistics) once, and the module keeps its own,
untouched copy until ``step.load_into(module)``. In place, as a torch optimizer does, the
step's store holds the module's tensors themselves (``Backend.share_written``: a NumPy
view, the C state block's pointer, a CPU torch tensor over the same memory), so training
holds one copy of them and the module holds the current values after every step. As with
a torch optimizer, an in-place change to the module's tensors (``load_state_dict``) is a
change to the step's params; replacing one (``param.data = ...``) leaves the step on the
old memory.

Where a value cannot be shared the step copies it as by default and says so (a warning
from ``bind_in_place``, and ``step.in_place``): after every step it writes its copy back
into the module's tensor when that tensor has writable CPU memory of the same shape
(``written_back``: a 4-D weight the torch backend stores channels-last, a tensor of
another dtype or a non-contiguous one, a backend that keeps its own copies: ONNX Runtime,
CUDA, a mixed backend); otherwise the module sees it only through ``load_into``
(``held``: a bfloat16 or CUDA tensor, a LoRA adapter, which the module does not have).

A backend whose kernels return new arrays instead of writing their inputs (NumPy) has the
new values copied into the shared memory after the run (``ModuleHomes.sync``). A step
with a NaN/inf loss writes nothing in the graph, so the module is unchanged by it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pockengine.backends import Backend
from pockengine.backends.base import NotShareableError
from pockengine.ir import Graph, TensorType, get_op
from pockengine.ir.arrays import Array

__all__ = ["InPlace", "ModuleHomes", "bind_in_place", "module_memory"]

log = logging.getLogger("pockengine.step.compiler")  # the logger compile's messages use
_LISTED = 4  # names a warning lists per reason


@dataclass(frozen=True)
class InPlace:
    """How a step compiled with ``in_place=True`` holds the module's values it writes, by
    model name. ``shared``: trained in the module's own memory; ``written_back``: the step
    keeps a copy and writes it into the module's tensor after every step (name -> why);
    ``held``: the step's own, in the module only through ``load_into`` (name -> why)."""

    shared: tuple[str, ...] = ()
    written_back: dict[str, str] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)

    def note(self) -> str | None:
        """One line on what is copied and why, or None when everything is shared."""
        parts = []
        for how, table in (
            ("written back after every step", self.written_back),
            ("held by the step (load_into writes them)", self.held),
        ):
            by_reason: dict[str, list[str]] = {}
            for name, why in table.items():
                by_reason.setdefault(why, []).append(name)
            for why, names in by_reason.items():
                more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
                parts.append(f"{how}: {', '.join(names[:_LISTED])}{more} ({why})")
        if not parts:
            return None
        copied = len(self.written_back) + len(self.held)
        total = copied + len(self.shared)
        head = f"in_place=True: {copied} of the {total} module values the step writes are copied"
        return f"{head}, not shared; " + "; ".join(parts)


class ModuleHomes:
    """The module memory a step writes: ``shared`` (IR name -> the module's array and the
    store's value over it) and ``back`` (IR name -> the module's array the step's own copy
    is written into)."""

    def __init__(self) -> None:
        self.shared: dict[str, tuple[Array, Any]] = {}
        self.back: dict[str, Array] = {}
        self.report = InPlace()

    def sync(
        self, store: MutableMapping[str, Any], backend: Backend, names: Iterable[str] | None = None
    ) -> None:
        """After a step (or a ``load_state``) replaced or wrote ``names`` (default: all):
        the module's tensors hold the step's values, and the store holds the shared ones."""
        for ir in self.shared if names is None else names:
            if ir in self.shared:
                home, lent = self.shared[ir]
                if store[ir] is not lent:  # kernels that return new arrays (NumPy)
                    np.copyto(home, backend.to_numpy(store[ir]))
                    store[ir] = lent
        for ir in self.back if names is None else names:
            if ir in self.back:
                np.copyto(self.back[ir], backend.to_numpy(store[ir]), casting="same_kind")


def module_memory(module: Any) -> tuple[dict[str, Array], dict[str, str]]:
    """Every param and buffer of a torch ``module`` (all names of tied ones) as a NumPy
    array over its memory; and for those that have none (CUDA, bfloat16), why."""
    arrays: dict[str, Array] = {}
    why: dict[str, str] = {}
    named = (*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False))  # fmt: skip
    for name, tensor in named:
        if tensor.device.type != "cpu":
            why[name] = f"the module's tensor is on {tensor.device}"
            continue
        try:
            arrays[name] = tensor.detach().numpy()
        except (TypeError, RuntimeError):
            why[name] = f"the module's tensor is {tensor.dtype}, which NumPy cannot view"
    return arrays, why


def bind_in_place(
    module: Any,
    graph: Graph,
    state_names: Mapping[str, str],
    values: dict[str, Any],
    backend: Backend,
    store: MutableMapping[str, Any],
) -> ModuleHomes:
    """Move the module's values that ``graph`` writes out of ``values`` into ``store``:
    the module's own memory where ``backend`` can train it in place, else a copy (module
    doc). Warns once, naming what is copied and why."""
    arrays, no_view = module_memory(module)
    written = {n.inputs[i].name for n in graph.nodes for i in get_op(n.op).mutates}
    types = {v.name: v.type for v in graph.inputs}
    homes = ModuleHomes()
    shared: list[str] = []
    back: dict[str, str] = {}
    held: dict[str, str] = {}
    for ir in sorted(written & set(values) & set(state_names)):
        name, value = state_names[ir], values.pop(ir)
        home = arrays.get(name)
        reason, lent = _share(home, value, types[ir], backend)
        if reason is None:
            assert home is not None
            store[ir] = lent
            homes.shared[ir] = (home, lent)
            shared.append(name)
            continue
        store[ir] = backend.from_numpy(value)
        if home is None:
            held[name] = no_view.get(name, "the module has no such tensor (a LoRA adapter)")
        elif home.flags.writeable and home.shape == types[ir].shape:
            homes.back[ir] = home
            back[name] = reason
        else:
            held[name] = reason
    homes.report = InPlace(tuple(shared), back, held)
    note = homes.report.note()
    if note is not None:
        log.warning("%s", note)
    return homes


def _share(
    home: Array | None, value: Any, vtype: TensorType, backend: Backend
) -> tuple[str | None, Any]:
    """(None, the store's value over ``home``) if the step can train ``home`` in place,
    else (why not, None)."""
    if home is None:
        return "the module has no NumPy-visible tensor", None
    if home.shape != vtype.shape:
        return f"shape {list(home.shape)} in the module, {list(vtype.shape)} in the step", None
    if home.dtype != vtype.dtype.to_numpy():
        return f"{home.dtype} in the module, {vtype.dtype} in the step", None
    if not (home.flags.c_contiguous and home.flags.writeable):
        return "not contiguous, writable memory in the module", None
    same = np.asarray(value).__array_interface__["data"][0] == home.__array_interface__["data"][0]
    if not same and not np.array_equal(value, home):
        return "the step's initial value is not the module's tensor", None
    try:
        return None, backend.share_written(home)
    except NotShareableError as exc:
        return str(exc), None
