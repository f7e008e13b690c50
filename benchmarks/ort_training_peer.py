"""ONNX Runtime's on-device training API (``onnxruntime-training``) as a step_bench peer.

``onnxruntime-training`` replaces ``onnxruntime`` (the main environment needs the newer
inference package), so it lives in its own virtual environment at the repository root::

    python benchmarks/ort_training_peer.py --create-venv     # makes .venv-ort-training/

One case (``run_case``, called by ``step_bench.py --case WORKLOAD SCHEME ort-training``):

1. main environment: the zoo model *plus its loss* is exported to ONNX in training mode
   (the TorchScript exporter, or the dynamo one where that fails); ``make_batch(0)``
   goes to an ``.npz``; the loss of the first step is computed with torch eager on the
   same weights and batch, for the check.
2. venv, one process: ``onnxruntime.training.artifacts.generate_artifacts`` with the
   scheme's trained parameters as ``requires_grad``, every other parameter and buffer
   as ``frozen_params``, no loss block (the model's output is the loss) and the
   workload's optimizer (AdamW with its hyper-parameters; plain SGD for the CNNs, as
   ORT's SGD has no momentum).
3. venv, a fresh process: CheckpointState, Module and Optimizer (2 intra-op threads),
   warm-up and measured steps; it prints the same fields as step_bench's ``run_case``.

compile_s is artifact generation plus session creation; train_mem_mib is peak RSS over
the measured steps minus the RSS once the artifacts and the batch are loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, reset_peak, vm_kib

VENV = ROOT / ".venv-ort-training"
# onnxruntime-training 1.19.2 is built against ONNX 1.16 (IR version 10): a newer onnx
# would stamp the artifacts with an IR version this runtime refuses.
REQUIREMENTS = ("onnxruntime-training==1.19.2", "onnx==1.16.2", "numpy<2")
LOSS_RTOL = 1e-3


def venv_python() -> Path:
    return VENV / "bin" / "python"


def venv_possible() -> bool:
    """The venv is there, or this interpreter can make one (venv and ensurepip present)."""
    if venv_python().exists():
        return True
    return all(importlib.util.find_spec(m) is not None for m in ("venv", "ensurepip"))


def ensure_venv() -> str | None:
    """Make .venv-ort-training/ unless it works already; None, or why it could not."""
    probe = "import onnxruntime, onnx; print(onnxruntime.__version__)"
    py = str(venv_python())
    if venv_python().exists():
        out = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip() == "1.19.2":
            return None
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(VENV)],
        [py, "-m", "pip", "install", "--quiet", *REQUIREMENTS],
        [py, "-c", probe],
    ]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            lines = [ln for ln in out.stderr.splitlines() if "is ignored" not in ln]
            return f"{' '.join(cmd[:4])}: {lines[-1] if lines else 'failed'}"
    return None


# -- main environment: export, batch, reference loss -------------------------------------


def _export(model: Any, loss_fn: Any, batch: tuple[Any, ...], path: Path) -> str:
    """The model and its loss as one ONNX graph with a scalar output "loss"; the exporter."""
    import torch

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *b: Any) -> Any:
            return loss_fn(self.model, *b)

    wrapped = WithLoss().train()
    names = [f"input{i}" for i in range(len(batch))]
    try:
        torch.onnx.export(wrapped, batch, str(path), input_names=names, output_names=["loss"],
                          dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=17)  # fmt: skip
        return "torchscript"
    except Exception as first:  # an unsupported ATen op: try the dynamo exporter
        try:
            torch.onnx.export(wrapped, batch, str(path), input_names=names,
                              output_names=["loss"], dynamo=True, optimize=False)  # fmt: skip
        except Exception as second:
            raise RuntimeError(f"export failed: torchscript: {first}; dynamo: {second}") from None
        return "dynamo"


def _optimizer_spec(opt: Any) -> dict[str, Any]:
    import pockengine as pe

    if isinstance(opt, pe.optim.SGD):
        return {"kind": "sgd", "lr": opt.lr, "momentum": opt.momentum}
    return {"kind": "adamw", "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay}  # fmt: skip


def _venv(mode: str, spec: Path, threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    out = subprocess.run([str(venv_python()), __file__, mode, str(spec)], capture_output=True,
                         text=True, env=env, check=False)  # fmt: skip
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise RuntimeError(f"{mode}: {lines[-1] if lines else 'failed'}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_case(
    workload: str, scheme_name: str, steps: int, warmup: int, threads: int, reference: list[float]
) -> dict[str, Any]:
    """One ort-training case, driven from the main environment (torch, pockengine).
    ``reference``: torch eager's first two losses on the same weights and batch. The first
    loss must agree to ``LOSS_RTOL`` (``loss_check``: the forward); the second checks the
    gradients and the update (``update_check``; SGD momentum first differs in the second
    update), and can be ill-conditioned in fp32: on MobileNetV2 full, torch's own fp32 and
    fp64 second losses differ by 1.6e-3."""
    import numpy as np

    from pockengine import zoo
    from pockengine.frontend.torch import torch_model_info

    error = ensure_venv()
    if error:
        raise RuntimeError(f"no {VENV.name}: {error}")
    work, optimizer = zoo.benchmark(workload)
    scheme = zoo.benchmark_schemes(workload)[scheme_name]
    batch = work.make_batch(0)
    trained = scheme.resolve(torch_model_info(work.model)).names
    numel = sum(p.numel() for n, p in work.model.named_parameters() if n in trained)
    state = [n for n, _ in work.model.named_parameters()] + [
        n for n, _ in work.model.named_buffers()
    ]
    with tempfile.TemporaryDirectory(prefix="ort-training-") as tmp:
        d = Path(tmp)
        start = time.perf_counter()
        exporter = _export(work.model, work.loss_fn, batch, d / "model.onnx")
        export_s = time.perf_counter() - start
        del work
        np.savez(d / "batch.npz", **{f"input{i}": t.numpy() for i, t in enumerate(batch)})
        spec = d / "spec.json"
        spec.write_text(json.dumps({
            "dir": tmp, "steps": steps, "warmup": warmup, "threads": threads,
            "requires_grad": sorted(f"model.{n}" for n in trained),
            "frozen": sorted(f"model.{n}" for n in state if n not in trained),
            "optimizer": _optimizer_spec(optimizer),
        }))  # fmt: skip
        generated = _venv("--generate", spec, threads)
        result = _venv("--run", spec, threads)
    ours = result["first_losses"][: len(reference)]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, reference, strict=True)]
    result.update(
        compile_s=generated["artifacts_s"] + result["session_s"], exporter=exporter,
        export_s=export_s, artifacts_s=generated["artifacts_s"], eager_first_losses=reference,
        loss_rel_diff=rel, loss_check="ok" if rel[0] <= LOSS_RTOL else "MISMATCH",
        update_check="ok" if max(rel) <= LOSS_RTOL else f"differs by {max(rel):.1e}",
        optimizer_note=generated["note"], trained_numel=generated["trained_numel"],
        freeze_check="ok" if generated["trained_numel"] == numel else f"MISMATCH (torch {numel})",
    )  # fmt: skip
    return result


# -- venv side: onnxruntime-training, onnx and numpy only ----------------------------------


def _import_training() -> Any:
    """onnxruntime.training without its package __init__, which imports torch (for ORTModule
    and the FP16 optimizer) only; artifacts and the on-device api need none of it."""
    import types

    import onnxruntime

    if "onnxruntime.training" not in sys.modules:
        pkg = types.ModuleType("onnxruntime.training")
        pkg.__path__ = [str(Path(onnxruntime.__file__).parent / "training")]
        sys.modules["onnxruntime.training"] = pkg
        onnxruntime.training = pkg  # type: ignore[attr-defined]
    return sys.modules["onnxruntime.training"]


# ORT's gradient builders read these optional outputs (saved statistics, the dropout mask,
# the log-probabilities); the exporters leave them out.
_OUTPUTS = {"LayerNormalization": 3, "Dropout": 2, "SoftmaxCrossEntropyLoss": 2}


def _make_trainable(model: Any) -> Any:
    """Rewrite what ORT 1.19 has no gradient for: CastLike (the dynamo exporter emits it)
    becomes Cast to the inferred type of its second input; optional outputs are named."""
    import onnx

    typed = onnx.shape_inference.infer_shapes(model)
    g = typed.graph
    dtypes = {v.name: v.type.tensor_type.elem_type
              for v in [*g.input, *g.value_info, *g.output]}  # fmt: skip
    dtypes.update((i.name, i.data_type) for i in g.initializer)
    for node in g.node:
        if node.op_type == "Constant":
            dtypes.update((o, node.attribute[0].t.data_type) for o in node.output)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "CastLike":
            if not dtypes.get(node.input[1]):
                raise RuntimeError(f"CastLike {node.name}: type of {node.input[1]} unknown")
            node = onnx.helper.make_node("Cast", [node.input[0]], list(node.output),
                                         name=node.name, to=dtypes[node.input[1]])  # fmt: skip
        for k in range(len(node.output), _OUTPUTS.get(node.op_type, 0)):
            node.output.append(f"{node.name or node.output[0]}_optional_output{k}")
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _generate(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnx

    _import_training()
    from onnxruntime.training import artifacts, onnxblock

    d = Path(spec["dir"])
    start = time.perf_counter()
    model = _make_trainable(onnx.load(str(d / "model.onnx")))
    onnx.save(model, str(d / "trainable.onnx"))
    inits = {i.name for i in model.graph.initializer}
    del model
    missing = [n for n in spec["requires_grad"] if n not in inits]
    if missing:
        raise RuntimeError(f"trained parameters not in the ONNX graph: {missing[:5]}")
    opt = spec["optimizer"]
    if opt["kind"] == "adamw":
        hyper = {k: opt[k] for k in ("eps", "weight_decay")} | {"betas": tuple(opt["betas"])}
        block: Any = onnxblock.optim.AdamW(bias_correction=True, **hyper)
        note = "AdamW as in zoo.benchmark (adam_mode 0: torch's update)"
    else:
        block = onnxblock.optim.SGD()
        note = f"SGD without momentum (ORT's SGD has none; zoo uses {opt['momentum']})"
    artifacts.generate_artifacts(
        str(d / "trainable.onnx"), requires_grad=spec["requires_grad"],
        frozen_params=[n for n in spec["frozen"] if n in inits], loss=None, optimizer=block,
        artifact_directory=str(d),
    )  # fmt: skip
    if opt["kind"] == "adamw":
        _torch_adamw(d / "optimizer_model.onnx")
    trained = sum(int(np.prod(i.dims)) for i in onnx.load(str(d / "trainable.onnx")).graph
                  .initializer if i.name in spec["requires_grad"])  # fmt: skip
    return {"artifacts_s": time.perf_counter() - start, "note": note, "trained_numel": trained}


def _torch_adamw(path: Path) -> None:
    """onnxblock's AdamW is Hugging Face's (adam_mode 1: decay after the update, eps
    outside the bias correction); adam_mode 0 is torch.optim.AdamW's, as the peers use."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "AdamWOptimizer" and attr.name == "adam_mode":
                attr.i = 0
    onnx.save(model, str(path))


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    _import_training()
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    d = Path(spec["dir"])
    batch = np.load(d / "batch.npz")
    inputs = [ort.OrtValue.ortvalue_from_numpy(batch[f"input{i}"]) for i in range(len(batch))]
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = spec["threads"]
    start = time.perf_counter()
    state = CheckpointState.load_checkpoint(str(d / "checkpoint"))
    # No eval model: its train-mode BatchNormalization (3 outputs) fails ORT's eval checks.
    module = Module(str(d / "training_model.onnx"), state, session_options=options)
    opt = Optimizer(str(d / "optimizer_model.onnx"), module)
    opt.set_learning_rate(spec["optimizer"]["lr"])
    module.train()
    session_s = time.perf_counter() - start
    base = vm_kib("VmRSS")
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            reset_peak()
        t = time.perf_counter()
        loss = module(*inputs)
        opt.step()
        module.lazy_reset_grad()
        losses.append(float(loss.numpy()))
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    peak = vm_kib("VmHWM")
    return {
        "step_ms": statistics.median(times) * 1e3, "session_s": session_s, "loss": losses[-1],
        "first_losses": losses[:2], "train_mem_mib": (peak - base) / 1024,
        "peak_rss_mib": peak / 1024, "base_rss_mib": base / 1024, "ort": ort.__version__,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--create-venv", action="store_true", help=f"make {VENV.name}/")
    group.add_argument("--generate", metavar="SPEC", help=argparse.SUPPRESS)
    group.add_argument("--run", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.create_venv:
        error = ensure_venv()
        print(error or f"ready: {venv_python()}")
        return 1 if error else 0
    spec = json.loads(Path(args.generate or args.run).read_text())
    print(json.dumps(_generate(spec) if args.generate else _run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
