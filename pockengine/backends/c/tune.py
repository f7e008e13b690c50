"""Per-node convolution kernels chosen by measurement (``CBackend(tune=True)``).

For each conv node (``conv_kernels.CONV_OPS``) with more than one valid kernel, every
candidate is timed on the node's exact geometry and dtype by the timing harness
(``tune_harness``; a warm-up run, then the median of a few) and the fastest is kept. A
candidate whose warm-up already takes more than ``_GIVE_UP`` times the best median so far
is dropped without further runs. The candidates of a node share one set of operands, and
nodes of one geometry are measured once. With ``beside`` (``layout_tune.layout_beside``) a
node that has the layout choice's candidates (``nhwc``, ``nchwc``) has them timed in the
same harness call, after its NCHW kernels (one harness library, one set of operands, no
second timing of the NCHW kernel); those times go to ``beside_times`` for
``layout_tune.choose_layouts``.

The choices are kept in ``conv-kernels.json`` under the C cache dir (``driver.cache_dir``),
keyed by op, dtype, geometry (shapes, strides, padding, dilation, groups), target (machine
and CPU model) and toolchain (compiler, version, flags), so a second compile of the same
model measures nothing. The file is data: it is validated on reading, an entry that is
malformed or names a kernel that cannot compute its node is measured again, and a file
that is not a valid table is ignored with a warning and written anew.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pockengine.backends.c import tune_harness
from pockengine.backends.c.conv_kernels import (
    CONV_OPS,
    KERNEL_NAMES,
    ConvGeometry,
    candidates,
    conv_geometry,
    rule_kernel,
)
from pockengine.backends.c.driver import cache_dir, has_fast_gemm, toolchain
from pockengine.ir import DType, Graph, Node
from pockengine.plan.report import KernelChoice

__all__ = ["CACHE_NAME", "Beside", "KernelChoice", "choose_kernels", "measure", "read_table",
           "table_key", "target_key", "write_table"]  # fmt: skip

log = logging.getLogger(__name__)

CACHE_NAME = "conv-kernels.json"
_FORMAT = "pockengine-conv-kernels"
_VERSION = 1
_GIVE_UP = 3.0  # a warm-up this many times the best median ends a candidate's timing
_BUDGET_S = 0.02  # a candidate's timed runs: about this long, 3 to 9 of them


@dataclass(frozen=True)
class Beside:
    """Variants timed after a node's NCHW kernels in their harness call: their names, the
    harness library that has them and every kernel (built on first use), their numbers
    there, and which of them a node has (``applies``: names, possibly none)."""

    names: tuple[str, ...]
    library: Callable[[], Any]
    codes: tuple[int, ...]
    applies: Callable[[Node], tuple[str, ...]]


def measure(
    op: str,
    kernels: list[str],
    dtype: DType,
    g: ConvGeometry,
    portable: bool | None,
    threads: int | None,
    beside: Beside | None = None,
    variants: tuple[str, ...] = (),
) -> dict[str, float]:
    """The median seconds of each of ``kernels`` (then of ``variants``, ``beside``'s) on
    ``g``, timed in turn on one set of operands (inf for one whose warm-up alone exceeds
    ``_GIVE_UP`` times the best median before it, or when the operands could not be
    allocated)."""
    names, library, codes = kernels, None, None
    if beside is not None and variants:
        names, library = [*kernels, *variants], beside.library()
        codes = (
            *(KERNEL_NAMES.index(k) for k in kernels),
            *(beside.codes[beside.names.index(v)] for v in variants),
        )
    seconds = tune_harness.harness_times(op, names, dtype, g, _BUDGET_S, _GIVE_UP, portable,
                                         threads, library, codes)  # fmt: skip
    return dict(zip(names, seconds, strict=True))


@functools.cache
def _target() -> str:
    """The machine and CPU model the timings hold for."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()} {model}".strip()


def _key(
    op: str,
    dtype: DType,
    g: ConvGeometry,
    toolchain_key: str,
    threads: int | None,
    timed: tuple[str, ...] | None = None,
) -> str:
    """The table key: op, dtype, geometry, threads, the candidates timed (a kernel added
    later makes a new key, so it is timed; default: ``candidates``), target and toolchain."""
    geometry = ",".join(str(x) for x in g.longs()[:16])
    flags = toolchain_key.replace("\n", " ")
    names = ",".join(candidates(op, g) if timed is None else timed)
    return f"{op} {dtype} g={geometry} threads={threads or 0} k={names} | {_target()} | {flags}"


def _valid_entry(entry: Any, names: tuple[str, ...] = KERNEL_NAMES) -> bool:
    if not isinstance(entry, dict) or set(entry) != {"kernel", "seconds"}:
        return False
    seconds = entry["seconds"]
    return (
        entry["kernel"] in names
        and isinstance(seconds, dict)
        and all(k in names for k in seconds)
        and all(
            isinstance(v, float | int) and not isinstance(v, bool) and v >= 0
            for v in seconds.values()
        )
        and entry["kernel"] in seconds
        and math.isfinite(seconds[entry["kernel"]])
    )


def _read(
    path: Path, quiet: bool = False, names: tuple[str, ...] = KERNEL_NAMES
) -> tuple[dict[str, Any], bool]:
    """The valid entries (kernels among ``names``) of the table at ``path`` and whether the
    file needs rewriting (each problem logged as a warning unless ``quiet``)."""
    warn = (lambda *args: None) if quiet else log.warning
    if not path.exists():
        return {}, False
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        warn("ignoring the C kernel table %s (not JSON: %s); it is written anew", path, exc)
        return {}, True
    ok = isinstance(data, dict) and data.get("format") == _FORMAT
    ok = ok and data.get("version") == _VERSION and isinstance(data.get("entries"), dict)
    if not ok:
        warn(
            "ignoring the C kernel table %s (not a %s table, version %d); it is written anew",
            path,
            _FORMAT,
            _VERSION,
        )
        return {}, True
    entries = {
        k: v for k, v in data["entries"].items() if isinstance(k, str) and _valid_entry(v, names)
    }
    if len(entries) != len(data["entries"]):
        dropped = len(data["entries"]) - len(entries)
        warn("ignoring %d malformed entries of the C kernel table %s", dropped, path)
        return entries, True
    return entries, False


def _write(path: Path, entries: dict[str, Any], names: tuple[str, ...] = KERNEL_NAMES) -> None:
    """Merge ``entries`` into the table on disk (another process may have added some) and
    replace it atomically."""
    current, _ = _read(path, quiet=True, names=names)
    current.update(entries)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    body = {"format": _FORMAT, "version": _VERSION, "entries": current}
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _conv_nodes(graph: Graph) -> list[Node]:
    return [
        n for n in graph.nodes if n.op in CONV_OPS and n.outputs[0].dtype in tune_harness.DTYPES
    ]


def _measure_all(
    op: str,
    dtype: DType,
    g: ConvGeometry,
    names: tuple[str, ...],
    portable: bool | None,
    threads: int | None,
    beside: Beside | None,
    variants: tuple[str, ...],
) -> tuple[dict[str, Any], dict[str, float]]:
    """The table entry of a node's kernels, and the chosen kernel's and ``variants``'
    seconds when the variants were timed (else empty)."""
    # the rule's kernel first: its median is the bar the others' warm-ups must clear
    rule = rule_kernel(op, g, dtype.itemsize, fast_gemm=has_fast_gemm(portable))
    order = [rule, *(k for k in names if k != rule)]
    seconds = measure(op, order, dtype, g, portable, threads, beside, variants)
    timed = {k: v for k, v in seconds.items() if k in names and math.isfinite(v)}
    if not timed:  # nothing could be timed: the rule, unmeasured
        return {"kernel": rule, "seconds": {rule: 0.0}}, {}
    kernel = min(timed, key=lambda k: timed[k])
    extra = {v: seconds[v] for v in variants if v in seconds}
    variant = {kernel: timed[kernel], **extra} if extra else {}
    return {"kernel": kernel, "seconds": timed}, variant


def choose_kernels(
    graph: Graph,
    portable: bool | None = None,
    threads: int | None = None,
    beside: Beside | None = None,
    beside_times: dict[str, dict[str, float]] | None = None,
) -> list[KernelChoice]:
    """The measured (or cached) kernel of each conv node of ``graph`` that has more than
    one candidate; the table under the cache dir gains what was measured. A measured
    node that ``beside`` applies to has those variants timed in the same call: its
    output's name maps to the chosen kernel's and the variants' seconds in
    ``beside_times``."""
    path = cache_dir() / CACHE_NAME
    table, dirty = _read(path)
    tc_key = toolchain(portable).key
    fresh: dict[str, tuple[dict[str, Any], dict[str, float]]] = {}
    choices = []
    for node in _conv_nodes(graph):
        out = node.outputs[0]
        g = conv_geometry(node)
        names = candidates(node.op, g)
        if len(names) < 2:
            continue
        key = _key(node.op, out.dtype, g, tc_key, threads)
        cached = key not in fresh and key in table and table[key]["kernel"] in names
        if cached:
            entry = table[key]
        else:
            if key not in fresh:
                variants = beside.applies(node) if beside is not None else ()
                fresh[key] = _measure_all(node.op, out.dtype, g, names, portable, threads,
                                          beside, variants)  # fmt: skip
            entry, variant = fresh[key]
            if variant and beside_times is not None:
                beside_times[out.name] = dict(variant)
        choices.append(
            KernelChoice(node.op, out.name, entry["kernel"], dict(entry["seconds"]), cached)
        )
    if fresh or dirty:
        _write(path, {**table, **{k: entry for k, (entry, _) in fresh.items()}})
    return choices


# The table's helpers under public names, for the layout choice's own table (layout_tune.py)
read_table, write_table, table_key, target_key = _read, _write, _key, _target
