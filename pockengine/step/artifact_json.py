"""``step.json`` of a step artifact: everything a step runs with beside its graph and store.

``to_json(step, report, ...)`` writes, and ``from_json`` reads back, the facts
``pockengine.step.artifact`` needs to rebuild a step without the compiler: the batch inputs (by
name), IR -> model names and aliases, the quantized params, the trained params with their
partial-channel rows (the ``Resolution``), index bounds of the batch checks, the optimizer
(its class and fields), the model's param table (``ModelInfo``, which ``load_state`` and
the fine-tune's summary read), the scheme and the compile-time report at full depth
(``SavedReport.at_depth`` cuts its layers as ``analyze(graph, depth)`` would). Plain JSON
values only; ``from_json`` raises ``KeyError``/``TypeError``/``ValueError`` on a damaged
file, which ``artifact`` turns into one error naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pockengine import optim
from pockengine.frontend.imported import ModelInfo, ParamInfo
from pockengine.ir import DType, TensorType
from pockengine.passes.quantize import QuantizedParam
from pockengine.plan.index_bounds import IndexBound
from pockengine.plan.recomputation import Recomputation, Segment
from pockengine.plan.report import BackendMemory, Figures, KernelChoice, LayerFigures, Report
from pockengine.sparse import schemes
from pockengine.sparse.lora import Adapter
from pockengine.sparse.schemes import Resolution, Scheme
from pockengine.step.running import StepFacts

if TYPE_CHECKING:
    from pockengine.ir import Value
    from pockengine.plan.placement import Placement
    from pockengine.step.running import CompiledStep

__all__ = [
    "READABLE_FORMATS",
    "STEP_FORMAT",
    "Saved",
    "SavedReport",
    "facts_json",
    "from_json",
    "read_facts",
    "to_json",
]

STEP_FORMAT = 2  # 2: all-zero tensors listed in "zeros", not in the safetensors files
READABLE_FORMATS = (1, 2)
_OPTIMIZERS = {  # every optimizer class in pockengine.optim, by class name
    name: cls
    for name, cls in vars(optim).items()
    if isinstance(cls, type) and issubclass(cls, optim.Optimizer) and cls is not optim.Optimizer
}


@dataclass(frozen=True)
class SavedReport:
    """A ``Report`` as written at full depth; ``at_depth`` gives it at any depth."""

    scheme: str
    ours: Figures
    full: Figures
    recomputation: Recomputation | None

    def at_depth(
        self,
        depth: int | None,
        placement: Placement | None,
        kernels: tuple[KernelChoice, ...] = (),
        memory: BackendMemory | None = None,
    ) -> Report:
        """The report cut to ``depth``, with the loading backend's ``placement``,
        ``kernels`` (the kernels its executable chose: the loaded step's, not the saver's)
        and ``memory`` (its executable's own plan, where it has one)."""
        ours, full = (_cut(f, depth) for f in (self.ours, self.full))
        return Report(self.scheme, ours, full, placement, self.recomputation, kernels, memory)


def _cut(figures: Figures, depth: int | None) -> Figures:
    """The layers summed into their first ``depth`` path components (``report._layer``)."""
    if depth is None:
        return figures
    layers: dict[str, LayerFigures] = {}
    for name, row in figures.layers.items():
        key = name if name.startswith("<") else ".".join(name.split(".")[:depth])
        into = layers.setdefault(key, LayerFigures())
        for f in dataclasses.fields(LayerFigures):
            setattr(into, f.name, getattr(into, f.name) + getattr(row, f.name))
    return dataclasses.replace(figures, layers=layers)


@dataclass(frozen=True)
class Saved:
    """``step.json`` read back (the batch as names until ``with_batch`` binds the graph's)."""

    facts: StepFacts
    batch_names: list[str]
    optimizer: optim.Optimizer
    info: ModelInfo
    resolution: Resolution
    scheme: Scheme | None
    report: SavedReport
    backend: str | list[str]
    on_nonfinite: str
    graph_sha256: str
    evaluator: dict[str, Any] | None

    def with_batch(self, batch: tuple[Value, ...]) -> Saved:
        return dataclasses.replace(self, facts=dataclasses.replace(self.facts, batch=batch))


def to_json(
    step: CompiledStep, report: Report, graph_sha256: str, evaluator: dict[str, Any] | None
) -> dict[str, Any]:
    name = step.backend.name
    return {
        "format": STEP_FORMAT,
        "graph_sha256": graph_sha256,
        "backend": name.split("+") if "+" in name else name,
        **facts_json(step.facts, step.info, step.resolution),
        "optimizer": _optimizer_json(step.optimizer),
        "scheme": None if step.scheme is None else step.scheme.to_dict(),
        "report": _report_json(report),
        "on_nonfinite": step.on_nonfinite,
        "evaluator": evaluator,
    }


def facts_json(facts: StepFacts, info: ModelInfo, resolution: Resolution) -> dict[str, Any]:
    """The step's facts (the batch by name), the model's param table and the resolved
    scheme as JSON values: the part of ``step.json`` a compile child also writes
    (``pockengine.step.child``); ``read_facts`` reads it back."""
    return {
        "batch": [v.name for v in facts.batch],
        "state_names": facts.state_names,
        "aliases": {k: list(v) for k, v in facts.aliases.items()},
        "trained": list(facts.trained),
        "quantized": {k: _quantized_json(q) for k, q in facts.quantized.items()},
        "index_bounds": [{**asdict(b), "ignored": sorted(b.ignored)} for b in facts.index_bounds],
        "info": asdict(info),
        "resolution": asdict(resolution),
    }


def read_facts(meta: dict[str, Any]) -> tuple[StepFacts, list[str], ModelInfo, Resolution]:
    """``facts_json`` read back: the facts (no batch yet), the batch's names, the param
    table and the resolution."""
    aliases = {k: tuple(v) for k, v in meta["aliases"].items()}
    quantized = {k: _quantized(q) for k, q in meta["quantized"].items()}
    bounds = tuple(
        IndexBound(
            b["input"], int(b["high"]), frozenset(b["ignored"]), b["what"], int(b.get("low", 0))
        )  # older steps: no "low", all were 0
        for b in meta["index_bounds"]
    )
    state_names = {str(k): str(v) for k, v in meta["state_names"].items()}
    facts = StepFacts((), state_names, aliases, quantized, bounds, tuple(meta["trained"]))
    return facts, list(meta["batch"]), _info(meta["info"]), _resolution(meta["resolution"])


def from_json(meta: dict[str, Any]) -> Saved:
    facts, batch, info, resolution = read_facts(meta)
    scheme = None if meta["scheme"] is None else schemes.from_dict(meta["scheme"])
    return Saved(
        facts,
        batch,
        _optimizer(meta["optimizer"]),
        info,
        resolution,
        scheme,
        _report(meta["report"]),
        meta["backend"],
        str(meta["on_nonfinite"]),
        str(meta["graph_sha256"]),
        meta["evaluator"],
    )


def _quantized_json(q: QuantizedParam) -> dict[str, Any]:
    return {"dtype": str(q.type.dtype), "shape": list(q.type.shape), "inputs": list(q.inputs),
            "scheme": q.scheme, "group": q.group}  # fmt: skip


def _quantized(q: dict[str, Any]) -> QuantizedParam:
    kind = TensorType(tuple(int(d) for d in q["shape"]), DType(q["dtype"]))
    return QuantizedParam(kind, tuple(q["inputs"]), str(q["scheme"]), int(q["group"]))


def _optimizer_json(optimizer: optim.Optimizer) -> dict[str, Any]:
    if not dataclasses.is_dataclass(optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a dataclass: it cannot be saved")
    return {"kind": type(optimizer).__name__, **asdict(optimizer)}


def _optimizer(data: dict[str, Any]) -> optim.Optimizer:
    fields = dict(data)
    cls = _OPTIMIZERS.get(fields.pop("kind"))
    if cls is None:
        raise ValueError(f"unknown optimizer {data['kind']!r} (known: {sorted(_OPTIMIZERS)})")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return cls(**fields)


def _info(data: dict[str, Any]) -> ModelInfo:
    params = tuple(ParamInfo(**{**p, "shape": tuple(p["shape"])}) for p in data["params"])
    containers = {k: tuple(v) for k, v in data["containers"].items()}
    return ModelInfo(params, containers, data["head"], data["blocks"], dict(data["canonical"]))


def _resolution(data: dict[str, Any]) -> Resolution:
    adapters = tuple(Adapter(**a) for a in data["adapters"])
    return Resolution(
        dict(data["rows"]),
        bool(data["frozen_bn_eval"]),
        adapters,
        bool(data.get("running_bn", False)),
    )  # (older steps: absent)


def _report_json(report: Report) -> dict[str, Any]:
    out: dict[str, Any] = {"scheme": report.scheme, "ours": asdict(report.ours),
                           "full": asdict(report.full), "recomputation": None}  # fmt: skip
    if report.recomputation is not None:
        out["recomputation"] = asdict(report.recomputation)
    return out


def _figures(data: dict[str, Any]) -> Figures:
    layers = {k: LayerFigures(**v) for k, v in data["layers"].items()}
    return Figures(**{**data, "layers": layers})


def _report(data: dict[str, Any]) -> SavedReport:
    recomputation = None
    if data["recomputation"] is not None:
        r = data["recomputation"]
        segments = tuple(
            Segment(s["layer"], tuple(s["values"]), tuple(s["ops"]), s["flops"])
            for s in r["segments"]
        )
        recomputation = Recomputation(
            r["budget"], r["peak_before"], r["peak_after"], r["step_flops"], segments
        )
    return SavedReport(
        data["scheme"], _figures(data["ours"]), _figures(data["full"]), recomputation
    )
