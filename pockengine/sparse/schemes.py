"""Update schemes: which parameters train, and which output channels of a weight.

A scheme is a user-facing selector. It resolves once, against the model's
``ModelInfo`` (names, shapes, owning modules, repeated blocks, the head), to a
``Resolution``: the trained parameter names, each with the number of leading
output channels (rows) that train, or None for the whole tensor. Nothing inside
the engine matches names after that.

Factories: ``full()``, ``bias_only()``, ``head()``, ``last_blocks(k)``,
``select(train=..., freeze=...)`` and ``sparse(...)`` (the PockEngine recipe). Each
takes ``channels={pattern: ratio}`` for partial-channel updates and
``frozen_bn="eval"`` to run BatchNorm layers with no trained parameter on their
running statistics, and ``batchnorm="running"`` to run every BatchNorm layer on its
running statistics, trained ones too (they still learn their scale and shift; batch
statistics of small, shifted batches can cost a pretrained CNN more than they give:
docs/quality.md). ``lora(rank, alpha, targets)`` trains low-rank adapters that the
compile inserts (``pockengine.sparse.lora``); ``a | b`` trains what either scheme trains
(a ``union``). Schemes save to and load from small JSON/YAML files. What each kind
selects is in ``pockengine.sparse.selectors``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pockengine.frontend.imported import ModelInfo
from pockengine.ir import SchemeError
from pockengine.safe_write import write_text
from pockengine.sparse.lora import resolve_lora
from pockengine.sparse.resolution import Adapter, Resolution
from pockengine.sparse.scheme_file import read_scheme_data, shown, yaml_text
from pockengine.sparse.selectors import SELECTORS, block_params, channel_rows, matching

BATCHNORM_MODES = ("batch", "running")

__all__ = [
    "BATCHNORM_MODES",
    "SCHEME_FILES",
    "SCHEME_HELP",
    "SCHEME_NAMES",
    "Resolution",
    "Scheme",
    "bias_only",
    "full",
    "head",
    "last_blocks",
    "load",
    "lora",
    "named",
    "requires_grad",
    "resolve_scheme",
    "running_statistics",
    "save",
    "scheme_named",
    "select",
    "sparse",
]


@dataclass(frozen=True)
class Scheme:
    """A serialisable selector: ``kind`` plus its options (see the factories)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    channels: dict[str, float] = field(default_factory=dict)
    frozen_bn: str = "train"  # "train": batch statistics; "eval": running statistics
    # "batch": a BatchNorm that trains normalises by the batch; "running": every one by its
    # running statistics (then ``frozen_bn`` changes nothing)
    batchnorm: str = "batch"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scheme": self.kind, **self.options}
        if self.channels:
            out["channels"] = dict(self.channels)
        if self.frozen_bn != "train":
            out["frozen_bn"] = self.frozen_bn
        if self.batchnorm != "batch":
            out["batchnorm"] = self.batchnorm
        return out

    def __or__(self, other: Scheme) -> Scheme:
        """A scheme training what either trains (``lora(...) | bias_only()``); BatchNorms
        (that train nothing, or all) run on running statistics if either part asks for
        that."""
        if not isinstance(other, Scheme):
            return NotImplemented
        parts = [
            p
            for s in (self, other)
            for p in (s.options["schemes"] if s.kind == "union" else [s.to_dict()])
        ]
        eval_bn = "eval" in (self.frozen_bn, other.frozen_bn)
        running = "running" in (self.batchnorm, other.batchnorm)
        return Scheme(
            "union",
            {"schemes": parts},
            {},
            "eval" if eval_bn else "train",
            "running" if running else "batch",
        )

    def resolve(self, info: ModelInfo) -> Resolution:
        if self.kind == "union":
            return _resolve_union(self, info)
        if self.kind == "lora":
            lora = resolve_lora(info, **self.options)
            return Resolution(lora.rows, self.frozen_bn == "eval", lora.adapters, self._running)
        options = {k: v for k, v in self.options.items() if k != "channels"}
        chosen = SELECTORS[self.kind](info, **options)
        if not chosen:
            raise SchemeError(f"scheme {self.kind!r} trains no parameter of this model")
        rows: dict[str, int | None] = {name: None for name in chosen}
        partial = [
            (p, r)
            for pattern, r in self.channels.items()
            for p in matching(info, [pattern], "channels")
        ]
        block_ratio = self.options.get("channels")
        if self.kind == "sparse" and block_ratio is not None:
            blocks = block_params(info, options.get("blocks", 2), options.get("container"))
            partial += [(info.param(n), float(block_ratio)) for n in blocks]
        for p, ratio in partial:
            if p.name in rows and not p.is_bias and not p.is_norm and len(p.shape) >= 2:
                rows[p.name] = channel_rows(p, ratio)
        return Resolution(rows, self.frozen_bn == "eval", running_bn=self._running)

    @property
    def _running(self) -> bool:
        return self.batchnorm == "running"


def _resolve_union(scheme: Scheme, info: ModelInfo) -> Resolution:
    """Every part's trained params (a whole tensor where any part trains all of it)."""
    rows: dict[str, int | None] = {}
    adapters: list[Adapter] = []
    for part in (from_dict(d) for d in scheme.options["schemes"]):
        resolved = part.resolve(info)
        for name, k in resolved.rows.items():
            old = rows.get(name, k)
            rows[name] = None if old is None or k is None else max(old, k)
        adapters += [a for a in resolved.adapters if a not in adapters]
    if len({a.weight for a in adapters}) != len(adapters):
        raise SchemeError("two lora parts of a union adapt the same weight")
    return Resolution(
        rows, scheme.frozen_bn == "eval", tuple(adapters), scheme.batchnorm == "running"
    )


# -- factories ---------------------------------------------------------------------


def _scheme(
    kind: str,
    channel_map: Mapping[str, float] | None,
    frozen_bn: str,
    batchnorm: str = "batch",
    **opts: Any,
) -> Scheme:
    if frozen_bn not in ("train", "eval"):
        raise SchemeError(f"frozen_bn must be 'train' or 'eval', got {shown(frozen_bn)}")
    if batchnorm not in BATCHNORM_MODES:
        raise SchemeError(f"batchnorm must be 'batch' or 'running', got {shown(batchnorm)}")
    options = {k: v for k, v in opts.items() if v is not None}
    return Scheme(kind, options, dict(channel_map or {}), frozen_bn, batchnorm)


def running_statistics(scheme: Scheme) -> Scheme:
    """``scheme`` with every BatchNorm on its running statistics (``batchnorm="running"``)."""
    return dataclasses.replace(scheme, batchnorm="running")


def requires_grad(
    *, channels: Mapping[str, float] | None = None, frozen_bn: str = "train"
) -> Scheme:
    """Every parameter whose ``requires_grad`` is set (what ``scheme=None`` means)."""
    return _scheme("requires_grad", channels, frozen_bn)


def full(*, channels: Mapping[str, float] | None = None, frozen_bn: str = "train") -> Scheme:
    """Every parameter trains."""
    return _scheme("full", channels, frozen_bn)


def bias_only(*, frozen_bn: str = "train") -> Scheme:
    """Every bias and every normalisation parameter."""
    return _scheme("bias_only", None, frozen_bn)


def head(*, frozen_bn: str = "train") -> Scheme:
    """The last linear layer only."""
    return _scheme("head", None, frozen_bn)


def last_blocks(
    k: int,
    *,
    container: str | None = None,
    head: bool = True,
    channels: Mapping[str, float] | None = None,
    frozen_bn: str = "train",
) -> Scheme:
    """Every parameter of the last ``k`` repeated blocks (plus the head)."""
    return _scheme("last_blocks", channels, frozen_bn, k=k, container=container, head=head)


def select(
    train: Sequence[str] = ("*",),
    freeze: Sequence[str] = (),
    *,
    channels: Mapping[str, float] | None = None,
    frozen_bn: str = "train",
) -> Scheme:
    """Parameters matching a ``train`` glob and no ``freeze`` glob."""
    return _scheme("select", channels, frozen_bn, train=list(train), freeze=list(freeze))


def sparse(
    bias: str = "all",
    blocks: int = 2,
    channels: float | None = None,
    head: bool = True,
    *,
    container: str | None = None,
    frozen_bn: str = "train",
) -> Scheme:
    """The PockEngine recipe: biases and norms everywhere, the weights of the last
    ``blocks`` blocks (at output-channel ratio ``channels``), the head (whole)."""
    return _scheme(
        "sparse",
        None,
        frozen_bn,
        bias=bias,
        blocks=blocks,
        head=head,
        container=container,
        channels=channels,
    )


def lora(
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] | None = None,
    dropout: float = 0.0,
    *,
    seed: int = 0,
) -> Scheme:
    """Low-rank adapters on the linear layers ``targets`` (module globs such as
    ``"*q_proj"``, or PEFT-style names such as ``"q_proj"``; None: the model family's
    attention query/value projections, ``pockengine.sparse.lora.DEFAULT_TARGETS``). The
    adapters alone train; compose with ``|`` to train more (``lora() | head()``)."""
    opts: dict[str, Any] = {"rank": rank, "alpha": alpha, "dropout": dropout, "seed": seed}
    if targets is not None:
        opts["targets"] = [targets] if isinstance(targets, str) else list(targets)
    return _scheme("lora", None, "train", **opts)


# -- files ------------------------------------------------------------------------


# What a scheme file may say: each kind's options with their types (checked before use).
_COMMON: dict[str, tuple[type, ...]] = {"scheme": (str,), "frozen_bn": (str,),
                                        "batchnorm": (str,)}  # fmt: skip
_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {
    "requires_grad": {"channels": (dict, int, float)},
    "full": {"channels": (dict, int, float)},
    "bias_only": {},
    "head": {},
    "last_blocks": {"k": (int,), "container": (str,), "head": (bool,),
                    "channels": (dict, int, float)},
    "select": {"train": (list, str), "freeze": (list, str), "channels": (dict, int, float)},
    "sparse": {"bias": (str,), "blocks": (int,), "head": (bool,), "container": (str,),
               "channels": (int, float)},
    "lora": {"rank": (int,), "alpha": (int, float), "targets": (list, str),
             "dropout": (int, float), "seed": (int,)},
    "union": {"schemes": (list,)},
}  # fmt: skip
_KINDS = (*SELECTORS, "lora", "union")
_ENTRY_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "train": ((str,), "a string"), "freeze": ((str,), "a string"),
    "targets": ((str,), "a string"), "schemes": ((dict,), "a mapping"),
}  # fmt: skip
_TYPE_NAMES = {dict: "a mapping", int: "an integer", float: "a number", str: "a string",
               bool: "true/false", list: "a list"}  # fmt: skip


def _check_option(kind: str, key: str, value: Any) -> None:
    """A ``SchemeError`` naming ``key`` unless it is an option of ``kind`` of the right type;
    a misspelt name gets the nearest valid one."""
    allowed = {**_COMMON, **_OPTIONS[kind]}
    if key not in allowed:
        near = difflib.get_close_matches(shown(key), list(allowed), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise SchemeError(
            f"scheme {kind!r} has no option {shown(key)}{hint} (options: {sorted(allowed)})"
        )
    types = allowed[key]
    is_bool = isinstance(value, bool)
    if not isinstance(value, types) or (is_bool and bool not in types):
        want = " or ".join(_TYPE_NAMES[t] for t in types)
        raise SchemeError(f"scheme option {key!r} must be {want}, got {shown(value)}")
    entries = (
        value if isinstance(value, list) else value.values() if isinstance(value, dict) else ()
    )
    for entry in entries:
        good, what = _ENTRY_TYPES.get(key, ((int, float), "a number"))
        if not isinstance(entry, good) or isinstance(entry, bool):
            raise SchemeError(f"scheme option {key!r} holds {shown(entry)}, not {what}")


def from_dict(data: Mapping[str, Any]) -> Scheme:
    """A scheme from its dict form (``to_dict()``, a scheme file), every option checked."""
    data = dict(data)
    kind = data.pop("scheme", "select")
    if not isinstance(kind, str) or kind not in _KINDS:
        near = difflib.get_close_matches(shown(kind), list(_KINDS), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise SchemeError(f"unknown scheme {shown(kind)}{hint} (known: {sorted(_KINDS)})")
    for key, value in data.items():
        _check_option(kind, str(key), value)
    if kind == "last_blocks" and "k" not in data:
        raise SchemeError("scheme 'last_blocks' needs k, the number of blocks to train")
    if kind == "union":
        parts = [from_dict(d) for d in data.get("schemes", [])]
        if not parts:
            raise SchemeError("scheme 'union' needs a non-empty list of schemes")
        return _scheme(
            "union",
            None,
            str(data.get("frozen_bn", "train")),
            str(data.get("batchnorm", "batch")),
            schemes=[p.to_dict() for p in parts],
        )
    for key in ("train", "freeze", "targets"):
        if isinstance(data.get(key), str):
            data[key] = [data[key]]
    channels = data.pop("channels", None)
    frozen_bn = str(data.pop("frozen_bn", "train"))
    batchnorm = str(data.pop("batchnorm", "batch"))
    if kind == "sparse":  # its channels is the block ratio
        return _scheme(kind, None, frozen_bn, batchnorm, channels=channels, **data)
    if isinstance(channels, int | float):
        channels = {"*": float(channels)}
    return _scheme(kind, channels, frozen_bn, batchnorm, **data)


def save(scheme: Scheme, path: str | Path) -> None:
    """Write ``scheme`` as JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
    path = Path(path)
    data = scheme.to_dict()
    if path.suffix in (".yaml", ".yml"):
        text = yaml_text(data)
    else:
        text = json.dumps(data, indent=2) + "\n"
    write_text(path, text)


def load(path: str | Path) -> Scheme:
    """The scheme in a ``.json``/``.yaml``/``.yml`` file (``scheme_file.read_scheme_data``:
    size-capped, YAML anchors and aliases refused); errors name the file."""
    path = Path(path)
    data = read_scheme_data(path)
    if not isinstance(data, dict):
        raise SchemeError(f"scheme file {path} must hold a mapping, not {type(data).__name__}")
    try:
        return from_dict(data)
    except SchemeError as exc:
        raise SchemeError(f"scheme file {path}: {exc}") from None


def resolve_scheme(scheme: Scheme | None, info: ModelInfo) -> Resolution:
    return (scheme or requires_grad()).resolve(info)


def named(spec: str, *, sparse: Scheme | None = None, frozen_bn: str = "eval") -> Scheme:
    """The scheme a name stands for, as on the command line: full, bias, bias-only, sparse,
    head, last:K, lora:R, or a scheme file (``scheme_named``)."""
    return scheme_named(spec, sparse=sparse, frozen_bn=frozen_bn)


# -- names -------------------------------------------------------------------------


SCHEME_NAMES = {
    "full": "every parameter",
    "bias": "every bias and normalisation parameter, and the head",
    "bias-only": "every bias and normalisation parameter, nothing else",
    "sparse": "the model's sparse recipe (biases, norms, the last blocks' weights, the head)",
    "head": "the last linear layer",
    "last:K": "every parameter of the last K repeated blocks, and the head",
    "auto": "chosen by the fine-tuner: gradient estimate + search under --memory-budget",
    "lora:R": "LoRA adapters of rank R (default 8) on the attention q/v projections, the head",
}
SCHEME_FILES = (".json", ".yaml", ".yml")
SCHEME_HELP = f"{', '.join(SCHEME_NAMES)}, or a scheme file (see docs/sparse_backprop.md)"
# the names that are one factory call (``scheme_named``; its ``sparse`` argument shadows the
# factory there)
_NAMED: dict[str, Callable[..., Scheme]] = {
    "full": full,
    "bias": lambda frozen_bn: sparse(blocks=0, frozen_bn=frozen_bn),
    "bias-only": bias_only,
    "head": head,
    "sparse": sparse,
}


def scheme_named(
    spec: str, *, sparse: Scheme | None = None, frozen_bn: str = "eval", lora_head: bool = True
) -> Scheme:
    """The scheme ``spec`` names, or the one a scheme file holds: the one vocabulary of
    scheme names, shared by ``pockengine inspect``, ``finetune``, ``search`` and ``export``
    and ``pe.schemes.named``, so each name trains the same parameters everywhere:

    - ``full``: every parameter (``full()``).
    - ``bias``: every bias and normalisation parameter, and the head: BitFit, with the head
      that a new task must train (``sparse(blocks=0)``).
    - ``bias-only``: every bias and normalisation parameter, nothing else (``bias_only()``).
    - ``sparse``: the model's sparse recipe: every bias and norm, the weights of the last 2
      blocks and the head (``sparse()``); a fine-tuning recipe or a benchmark workload may
      declare its own (the LLM recipe: norms and the output projections of every block).
    - ``head``: the last linear layer (``head()``).
    - ``last:K``: every parameter of the last K repeated blocks, and the head
      (``last_blocks(K)``).
    - ``auto``: chosen by ``pockengine finetune`` from the model and the data (a gradient
      estimate, then the budgeted search: ``pockengine.finetune.auto_scheme``); no command
      without the data can resolve it here.
    - ``lora``, ``lora:R``: LoRA adapters of rank R (default 8, alpha 2R) on the attention
      query and value projections of the model family (``q_proj``/``v_proj``,
      ``query``/``value``, ...: ``pockengine.sparse.lora.DEFAULT_TARGETS``), and the head
      (``lora(R, 2R) | head()``): a classifier's head is new and must train. A recipe whose
      head is pretrained (the causal-LM recipe) trains the adapters alone (``lora_head=False``).

    A path ending in ``.json``, ``.yaml`` or ``.yml`` is a scheme file (``load``).
    BatchNorm layers that train nothing run on their running statistics under a named
    scheme (``frozen_bn="eval"``, the default of every command): a short fine-tune barely
    moves those statistics, and layers trained on batch statistics would meet different ones at
    evaluation. ``frozen_bn="train"`` keeps batch statistics (the benchmark tables use it).

    ``sparse`` is what ``sparse`` means for this model (a recipe's or a workload's own;
    default ``sparse()``); ``frozen_bn`` applies to every named scheme, not to a
    file, which says its own; ``lora_head`` whether ``lora`` trains the head too.
    """
    if Path(spec).suffix in SCHEME_FILES:
        return load(spec)
    if spec == "lora" or spec.startswith("lora:"):
        return _lora(spec, _checked(frozen_bn), lora_head)
    if spec.startswith("last:"):
        k = spec.split(":", 1)[1]
        if not k.isdigit():
            raise SchemeError(f"scheme {spec!r}: last:K needs a whole number of blocks K")
        return last_blocks(int(k), frozen_bn=frozen_bn)
    if spec == "auto":
        raise SchemeError(
            "scheme 'auto' is chosen by pockengine finetune from the model and the data; "
            "here, give the scheme a run chose (its summary.json) or another name"
        )
    if spec == "sparse":
        return dataclasses.replace(sparse or _NAMED["sparse"](), frozen_bn=_checked(frozen_bn))
    if spec not in _NAMED:
        near = difflib.get_close_matches(spec, list(SCHEME_NAMES), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        choices = f"a scheme file ({'/'.join(SCHEME_FILES)}) or one of {', '.join(SCHEME_NAMES)}"
        raise SchemeError(f"unknown scheme {spec!r}{hint}: {choices}")
    return _NAMED[spec](frozen_bn=frozen_bn)


def _lora(spec: str, frozen_bn: str, with_head: bool) -> Scheme:
    rank = spec.split(":", 1)[1] if ":" in spec else "8"
    if not rank.isdigit() or int(rank) < 1:
        raise SchemeError(f"scheme {spec!r}: lora:R needs a whole rank R >= 1")
    adapters = dataclasses.replace(lora(int(rank), 2 * int(rank)), frozen_bn=frozen_bn)
    return adapters | head(frozen_bn=frozen_bn) if with_head else adapters


def _checked(frozen_bn: str) -> str:
    if frozen_bn not in ("train", "eval"):
        raise SchemeError(f"frozen_bn must be 'train' or 'eval', got {frozen_bn!r}")
    return frozen_bn
