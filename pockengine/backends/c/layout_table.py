"""The exported trainer's layout candidates, and the layouts ``./train --tune`` measured.

An exported trainer's layouts are fixed when it is exported (``layout.py``: the heuristic's
by default). ``convs.c`` also lists every convolution that has an NHWC kernel
(``layout.nhwc_candidate``) in its NCHW form, before the layout pass: its name, op, dtype,
geometry, NCHW kernels, its channel block when it has an NCHW{c}c kernel (depthwise ones,
``layout.layout_candidates``) and the layout this export gave it, with a fingerprint of
them all (``layout_table_source``). ``./train --tune`` times each one's fastest NCHW kernel
against NHWC and, where it has one, NCHW{c}c, each with its conversions (``layout_tune``'s
harness variants), and writes ``conv-layouts.txt`` (``trainer/pe_tune.c``; the fastest
layout where it takes less than 0.9 of NCHW's time, as in process). A later export reads
that file back (``read_layouts``; ``pockengine export --layouts``, ``step.export(...,
layouts=...)``) and takes its layouts instead of the heuristic's.

The file is data, checked line by line before anything is exported:

    pockengine-conv-layouts 2 <fingerprint>
    <node name> <nchw|nhwc|nchwc> <NCHW seconds> <NHWC seconds> <NCHWc seconds>

(NCHWc seconds 0 for a node without that kernel). A fingerprint of another step (another
model, batch or dtype), a name that is not one of this step's layout candidates, a
repeated name, a layout other than ``nchw``, ``nhwc`` or (where the node has it)
``nchwc``, a time that is not a non-negative number or a missing node is refused with the
file, the line and what is wrong.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path

from pockengine.backends.c.conv_kernels import CONV_OPS, KERNEL_NAMES, candidates, conv_geometry
from pockengine.backends.c.conv_table import name_literal
from pockengine.backends.c.layout import NHWC, as_layouts, layout_candidates, nhwc_candidate
from pockengine.backends.c.tune_harness import DTYPES
from pockengine.ir import CompileError, Graph, Node
from pockengine.ops.layout import block_of

__all__ = [
    "LAYOUT_FILE",
    "LayoutFileError",
    "layout_fingerprint",
    "layout_nodes",
    "layout_table_source",
    "read_layouts",
]

LAYOUT_FILE = "conv-layouts.txt"  # what ./train --tune writes beside its kernel table
_FORMAT, _VERSION = "pockengine-conv-layouts", 2
_MAX_BYTES = 1 << 20  # a layout file is a line a convolution: far less than this


class LayoutFileError(CompileError):
    """A layout file that is not this step's: the message names the file and line."""


def layout_nodes(graph: Graph) -> list[Node]:
    """The conv nodes of ``graph`` (lowered for C, before the layout pass) that have an
    NHWC kernel, in graph order."""
    return [
        n
        for n in graph.nodes
        if n.op in CONV_OPS and n.outputs[0].dtype in DTYPES and nhwc_candidate(n) is not None
    ]


def _blocked(node: Node) -> str | None:
    """The node's NCHW{c}c layout, or None when it has no blocked kernel."""
    return next((c for c in layout_candidates(node) if c != NHWC), None)


def _code(layout: str | None) -> int:
    """A layout as the kernels code it (``ops.layout.block_of``), None as NCHW."""
    return block_of("layout table", layout or "NCHW")


def _facts(node: Node) -> str:
    g = conv_geometry(node)
    mask = sum(1 << KERNEL_NAMES.index(k) for k in candidates(node.op, g))
    dtype = DTYPES.index(node.outputs[0].dtype)
    block = _code(_blocked(node))
    return f"{node.outputs[0].name} {CONV_OPS.index(node.op)} {dtype} {g.longs()} {mask} {block}"


def layout_fingerprint(graph: Graph) -> str:
    """A digest of ``graph``'s layout candidates (names, ops, dtypes, geometries, kernels)."""
    text = "\n".join(_facts(n) for n in layout_nodes(graph))
    return hashlib.sha256(f"{_FORMAT} {_VERSION}\n{text}".encode()).hexdigest()[:16]


def layout_table_source(graph: Graph, layouts: Collection[str] | Mapping[str, str]) -> str:
    """The C definitions of ``pe_layout_nodes`` (``trainer/pe_tune.h``) for ``graph``
    (lowered, before the layout pass), ``layouts`` giving the layouts this export takes
    (as ``layout.apply_layouts``: a mapping, or names for NHWC)."""
    laid = as_layouts(layouts)
    nodes = layout_nodes(graph)
    arrays, rows = [], []
    for k, node in enumerate(nodes):
        g = conv_geometry(node)
        name = node.outputs[0].name
        mask = sum(1 << KERNEL_NAMES.index(c) for c in candidates(node.op, g))
        arrays.append(f"static const long pe_layout_g{k}[] = {{{', '.join(map(str, g.longs()))}}};")
        op, dt = CONV_OPS.index(node.op), DTYPES.index(node.outputs[0].dtype)
        block, layout = _code(_blocked(node)), _code(laid.get(name))
        rows.append(f"    {{{name_literal(name)}, {op}, {dt}, pe_layout_g{k}, {mask}, {block}, "
                    f"{layout}}},")  # fmt: skip
    return "\n".join([
        "/* The convolutions with an NHWC or NCHW{c}c kernel (layout_table.py), for "
        "./train --tune. */",
        f"const int pe_num_layout_nodes = {len(nodes)};",
        f'const char pe_layout_fingerprint[] = "{layout_fingerprint(graph)}";',
        *arrays,
        f"const pe_layout_node pe_layout_nodes[{max(len(nodes), 1)}] = {{",
        *(rows or ['    {"", 0, 0, 0, 0, 0, 0},']),
        "};",
        "",
    ])  # fmt: skip


def _seconds(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value >= 0


def read_layouts(path: str | os.PathLike[str], graph: Graph) -> dict[str, str]:
    """The layouts (NHWC or NCHW{c}c, by node) the layout file at ``path`` takes, checked
    against ``graph`` (lowered for C, before the layout pass); a ``LayoutFileError``
    naming the file and line for anything else (the module docstring)."""
    file = Path(path)
    try:
        with file.open("rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise LayoutFileError(f"{file}: cannot read the layout file: {exc.strerror}") from None
    if len(data) > _MAX_BYTES:
        raise LayoutFileError(f"{file}: larger than {_MAX_BYTES} bytes: not a layout file")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise LayoutFileError(f"{file}: not text (UTF-8): not a layout file") from None
    header = f"{_FORMAT} {_VERSION} {layout_fingerprint(graph)}"
    if not lines or lines[0] != header:
        raise LayoutFileError(
            f"{file}:1: not the layouts of this step (expected '{header}'): measure them with "
            "./train --tune of a trainer exported from this step"
        )
    nodes = {n.outputs[0].name: n for n in layout_nodes(graph)}
    order, names = list(nodes), set(nodes)
    chosen: dict[str, str] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        parts = line.split(" ")
        if len(parts) != 5:
            raise LayoutFileError(
                f"{file}:{lineno}: expected '<node> <nchw|nhwc|nchwc> <NCHW seconds> "
                "<NHWC seconds> <NCHWc seconds>'"
            )
        name, layout, *times = parts
        if name not in names:
            raise LayoutFileError(f"{file}:{lineno}: {name!r} is not a convolution of this "
                                  "step with an NHWC kernel")  # fmt: skip
        if name in chosen:
            raise LayoutFileError(f"{file}:{lineno}: {name!r} appears twice")
        if layout not in ("nchw", "nhwc", "nchwc"):
            raise LayoutFileError(f"{file}:{lineno}: layout {layout!r} is not nchw, nhwc or nchwc")
        if layout == "nchwc" and _blocked(nodes[name]) is None:
            raise LayoutFileError(f"{file}:{lineno}: {name!r} has no NCHW{{c}}c kernel")
        if not all(_seconds(t) for t in times):
            raise LayoutFileError(f"{file}:{lineno}: the times must be seconds >= 0")
        chosen[name] = layout
    missing = [name for name in order if name not in chosen]
    if missing:
        raise LayoutFileError(f"{file}: no layout for {', '.join(missing[:5])}"
                              + (" ..." if len(missing) > 5 else ""))  # fmt: skip
    laid = {"nhwc": lambda n: NHWC, "nchwc": _blocked}
    return {
        name: str(laid[layout](nodes[name])) for name, layout in chosen.items() if layout != "nchw"
    }
