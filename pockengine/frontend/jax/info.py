"""The params pytree of a JAX model as the engine sees it: named leaves and a ModelInfo.

- names: the pytree key path joined with "/" (``params/Dense_0/kernel``; a Flax nnx
  ``Variable``'s trailing ``value`` is dropped); the IR name joins the same keys with
  "." (IR names allow no "/"), and ModelInfo lists the "/" name as an alias so that
  scheme patterns may use either;
- params and buffers: in a Flax variables dict (a mapping with a ``params`` key) only the
  ``params`` collection trains and the others (``batch_stats``, ...) are buffers; an nnx
  ``Variable`` that is not a ``Param`` (``BatchStat``) is a buffer; so is every leaf that
  is not floating point. Leaves that are not arrays (an Equinox module's functions) stay
  Python objects and are passed to the loss unchanged;
- module: the path without the leaf; module type: the Flax auto-name without its
  counter (``Dense_0`` -> ``Dense``), else guessed from the leaves (a 2-d ``kernel`` is a
  Dense, ``mean``/``var`` buffers a BatchNorm, ``scale`` alone a norm);
- containers: numbered children (``layers.0``, ``layers.1``) and Flax siblings with one
  auto-name (``Block_0``, ``Block_1`` -> container ``params.Block_*``); the blocks are the
  container with most children (ties: most parameters); the head is the last Dense-like
  module in natural order (``Dense_10`` after ``Dense_9``).
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.frontend.imported import ModelInfo, ParamInfo
from pockengine.ir import CompileError, Role
from pockengine.ir.arrays import Array

__all__ = ["Leaf", "Leaves", "flatten_params", "key_names", "model_info"]

_AUTO = re.compile(r"^(?P<kind>[A-Za-z]\w*?)_(?P<n>\d+)$")


@dataclass(frozen=True)
class Leaf:
    """One array leaf of the params pytree."""

    key: str  # the model's name: key path joined with "/"
    ir: str  # the IR name: key path joined with "."
    index: int  # position among all leaves of the pytree
    role: Role  # PARAM or BUFFER
    value: Array

    @property
    def module(self) -> str:
        return self.ir.rsplit(".", 1)[0] if "." in self.ir else ""

    @property
    def local(self) -> str:
        return self.ir.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Leaves:
    """The flattened pytree: its array leaves, and what rebuilds it."""

    treedef: Any
    objects: tuple[Any, ...]  # every leaf as given (arrays and static objects)
    arrays: tuple[Leaf, ...]  # the array leaves, in flattening order

    def rebuild(self, arrays: list[Any]) -> Any:
        """The pytree with its array leaves replaced by ``arrays`` (in order)."""
        leaves = list(self.objects)
        for leaf, value in zip(self.arrays, arrays, strict=True):
            leaves[leaf.index] = value
        return self.treedef.unflatten(leaves)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def key_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    names = tuple(_key_name(k) for k in path)
    if len(names) > 1 and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names = names[:-1]  # an nnx Variable's value: the variable is the leaf
    return names


def _buffer_prefixes(jax: Any, params: Any) -> set[tuple[str, ...]]:
    """Paths of Flax nnx variables that do not train (BatchStat and other non-Params)."""
    nnx = sys.modules.get("flax.nnx")  # nnx objects exist only if the user imported it
    if nnx is None:
        return set()
    variable = nnx.Variable
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, variable))
    out = set()
    for path, leaf in found[0]:
        if isinstance(leaf, variable) and not isinstance(leaf, nnx.Param):
            out.add(tuple(_key_name(k) for k in path))
    return out


def _role(names: tuple[str, ...], value: Array, root: Any, buffers: set[tuple[str, ...]]) -> Role:
    if not np.issubdtype(value.dtype, np.floating):
        return Role.BUFFER
    if isinstance(root, Mapping) and "params" in root and names[0] != "params":
        return Role.BUFFER
    if any(names[: len(p)] == p for p in buffers):
        return Role.BUFFER
    return Role.PARAM


def flatten_params(jax: Any, params: Any) -> Leaves:
    """Name every array leaf of ``params`` and say whether it trains."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    buffers = _buffer_prefixes(jax, params)
    arrays: list[Leaf] = []
    seen: dict[str, str] = {}
    for index, (path, obj) in enumerate(flat):
        if not (hasattr(obj, "shape") and hasattr(obj, "dtype")):
            continue  # a static leaf (a function, a Python number): passed through as is
        names = key_names(path) or ("param",)
        key, ir = "/".join(names), ".".join(re.sub(r"\W", "_", n) or "_" for n in names)
        if ir in seen:
            raise CompileError(f"params {seen[ir]!r} and {key!r} both map to IR name {ir!r}")
        seen[ir] = key
        value = np.array(obj, copy=True)
        arrays.append(Leaf(key, ir, index, _role(names, value, params, buffers), value))
    if not arrays:
        raise CompileError("the params pytree holds no arrays")
    return Leaves(treedef, tuple(obj for _, obj in flat), tuple(arrays))


# -- ModelInfo ------------------------------------------------------------------------


def _natural(path: str) -> tuple[tuple[int, str], ...]:
    """Sort key: "Dense_10" after "Dense_9", "layers.10" after "layers.9"."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", path))


def _module_type(module: str, leaves: list[Leaf]) -> str:
    last = module.rsplit(".", 1)[-1]
    auto = _AUTO.match(last)
    if auto and auto["kind"][0].isupper():
        return auto["kind"]
    local = {leaf.local: leaf for leaf in leaves}
    kernel = local.get("kernel") or local.get("weight")
    if kernel is not None and kernel.value.ndim == 2:
        return "Dense"
    if "embedding" in local:
        return "Embed"
    if {"mean", "var"} <= set(local):
        return "BatchNorm"
    if "scale" in local:
        return "Norm"
    return last if last[:1].isupper() else ""


def _channel_axis(leaf: Leaf) -> int:
    """JAX kernels keep output channels last ([in, out], HWIO); torch-layout weights
    (Equinox's ``weight``) and embedding tables keep them first."""
    if leaf.value.ndim < 2 or leaf.local in ("weight", "embedding"):
        return 0
    return leaf.value.ndim - 1


def _containers(
    modules: list[str], sizes: dict[str, int]
) -> tuple[dict[str, tuple[str, ...]], str | None]:
    children: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        parts = module.split(".")
        for i, part in enumerate(parts):
            child = ".".join(parts[: i + 1])
            auto = _AUTO.match(part)
            if part.isdigit():
                children[".".join(parts[:i])].add(child)
            elif auto and auto["kind"][0].isupper():
                children[".".join([*parts[:i], auto["kind"] + "_*"])].add(child)
    containers = {
        path: tuple(sorted(kids, key=_natural)) for path, kids in children.items() if len(kids) >= 2
    }

    def weight(path: str) -> tuple[int, int]:
        kids = containers[path]
        size = sum(
            n for m, n in sizes.items() if any(m == k or m.startswith(k + ".") for k in kids)
        )
        return (len(kids), size)

    return containers, max(containers, key=weight, default=None)


def model_info(leaves: Leaves) -> ModelInfo:
    """What schemes resolve against (see the module docstring)."""
    by_module: dict[str, list[Leaf]] = defaultdict(list)
    for leaf in leaves.arrays:
        by_module[leaf.module].append(leaf)
    ordered = sorted(
        (x for x in leaves.arrays if x.role is Role.PARAM), key=lambda x: _natural(x.ir)
    )
    params, sizes, head = [], dict.fromkeys(by_module, 0), None
    for leaf in ordered:
        kind = _module_type(leaf.module, by_module[leaf.module])
        shape = tuple(leaf.value.shape)
        params.append(ParamInfo(leaf.ir, shape, leaf.module, kind, True, _channel_axis(leaf)))
        sizes[leaf.module] += int(leaf.value.size)
        if kind in ("Dense", "DenseGeneral", "Linear") and leaf.value.ndim == 2:
            head = leaf.module
    modules = sorted({p.module for p in params}, key=_natural)
    containers, blocks = _containers(modules, sizes)
    aliases = {leaf.key: leaf.ir for leaf in ordered if leaf.key != leaf.ir}
    return ModelInfo(tuple(params), containers, head, blocks, aliases)
