"""``pockengine export``: a training step as ONNX + state for ``ort_runner.py``, as a
stand-alone C trainer folder, or as a step artifact (``pockengine.load_step`` runs it
without the compiler; ``pockengine.step.artifact``).

What it exports, by the first argument:

- a run folder (``RUN/checkpoint.safetensors``): the step of that fine-tune, rebuilt from
  the options stored in its checkpoint, with its trained weights and optimizer state;
- nothing, with ``--recipe`` or ``--model/--data`` and the other ``pockengine finetune``
  options: the step that fine-tune would compile, with its initial weights;
- a benchmark workload (mlp, cnn, bert, ...) or a ``model.onnx``.

A fine-tune's export is a folder: the artifact, ``ort_runner.py`` beside an ONNX step,
``README.txt`` with the command that runs it and the layout of its batch files, and with
``--write-batches N`` the first N training batches in that layout, to try it at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from pockengine.finetune.trained.gguf_lora import ADAPTER_TARGETS
from pockengine.ir import PockEngineError, Role, Value
from pockengine.ir.arrays import Array
from pockengine.out_folder import EXPORT, OutFolder, building, claim
from pockengine.safe_write import write_bytes, write_text, write_with
from pockengine.tasks.config import FinetuneConfig

__all__ = ["ExportError", "batch_inputs", "readme", "register", "write_export"]


# Options that set what a fine-tune trains (defaults: None); a run folder fixes them all.
_FINETUNE_OPTIONS = ("recipe", "model", "data", "tokenizer", "epochs", "batch_size", "seq_len",
                     "image_size", "max_train", "max_val", "lr", "scheme", "optimizer",
                     "text_column", "label_column", "encoding", "weight_decay", "momentum",
                     "warmup", "val_fraction", "dedupe", "seed")  # fmt: skip
_ONNX_MODEL_OPTIONS = ("loss", "output", "frozen_bn")
_ALWAYS = (
    "source", "target", "out", "force", "backend", "threads", "run", "defaults", "layouts",
)  # fmt: skip
_RUN_OPTIONS = ("write_batches", "factory", "state")  # what goes with a run folder
_ORT_RUNNER = Path(__file__).with_name("ort_runner.py")


_DESCRIPTION = """\
Write a training step as ONNX + state for ort_runner.py (--target onnx), as a C folder
whose make builds a stand-alone ./train (--target c), or as a step artifact that
pockengine.load_step runs without the compiler (--target step). What it exports:

  RUN                       a run folder of pockengine finetune: its step, with the run's
                            trained weights and optimizer state (the run's data must be
                            where it was, to rebuild the model and write batches)
  --recipe R | --model M --data D [finetune options]
                            the step that fine-tune compiles, with its initial weights
  WORKLOAD | model.onnx     a benchmark workload (mlp, cnn, bert, ...) or an ONNX model

A fine-tune's export is a folder (default RUN/export_<target> or train_step_<target>)
holding README.txt: the command that runs it and the layout of its batch files. The folder
is built aside and put in place at the end (a failed export leaves nothing); -o must be
new, empty or an earlier export, or --force replaces only the files an export writes.
--write-batches N also writes the first N training batches in that layout. Options that
only steer a run (--resume, --max-steps, --progress, ...) are accepted and ignored, so a
finetune command line can be reused."""


class ExportError(PockEngineError):
    """An export that cannot run: options that conflict, a folder that is not a run."""


@dataclass
class _Prepared:
    """A compiled step and, for a fine-tune, the task whose data it trains on."""

    step: Any  # TrainStep
    what: str
    config: FinetuneConfig | None = None
    train: tuple[Array, ...] = ()
    labels: tuple[str, ...] = ()
    kind: str = "classify"


# -- the command line ------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``export`` to the ``pockengine`` subcommands."""
    from pockengine.finetune.cli import EPILOG, add_arguments, positive_int
    from pockengine.run_cli import FACTORY_HELP
    from pockengine.sparse.schemes import SCHEME_HELP

    p = sub.add_parser(
        "export",
        help="write a training step (a run, a fine-tune, a workload, an .onnx) as "
        "ONNX + state for ort_runner, or as a stand-alone C trainer",
        description=_DESCRIPTION,
        epilog=EPILOG.split("\n\n")[0],
        conflict_handler="resolve",
    )
    p.add_argument(
        "source",
        nargs="?",
        help="a run folder, a workload (mlp, cnn, bert, ...) or "
        "a model.onnx; leave out to export --recipe or --model/--data",
    )
    add_arguments(p)
    p.add_argument(
        "--scheme",
        help=f"what trains: {SCHEME_HELP} (default, for a fine-tune: "
        "full for a module:factory model, sparse for the others, as an export runs "
        "no analysis; for a workload or .onnx: full)",
    )
    p.add_argument(
        "-o",
        "--out",
        help="the folder to write (default RUN/export_<target>, "
        "train_step_<target>); for a workload or .onnx, an .onnx file (default "
        "train_step.onnx) or, for --target c, the folder",
    )
    p.add_argument(
        "--target",
        choices=("onnx", "c", "step", *ADAPTER_TARGETS),
        default="onnx",
        help="onnx: ONNX + state for ort_runner; c: a folder whose make builds ./train; "
        "step: a folder pockengine.load_step runs; gguf-lora: a LoRA run's adapter "
        "as llama.cpp's GGUF adapter (--lora); peft: as PEFT's adapter folder "
        "(default onnx)",
    )
    p.add_argument(
        "--state",
        metavar="FILE",
        help="gguf-lora, peft: a ./train --save file "
        "whose LoRA factors replace the run's (the device's fine-tune)",
    )
    p.add_argument(
        "--layouts",
        metavar="FILE",
        help="--target c: the layouts a trainer of this step measured (./train --tune's "
        "conv-layouts.txt) instead of the heuristic's",
    )
    p.add_argument(
        "--write-batches",
        type=positive_int,
        metavar="N",
        help="also write the first N training batches of the fine-tune",
    )
    p.add_argument(
        "--frozen-bn",
        choices=("eval", "train"),
        default="eval",
        help="workloads and .onnx: BatchNorm that trains nothing under a named "
        "scheme uses running (eval) or batch (train) statistics",
    )
    p.add_argument(
        "--loss",
        default="cross_entropy",
        help="for an .onnx model: cross_entropy, mse, causal_lm or none",
    )
    p.add_argument("--output", help="for an .onnx model: the output the loss applies to")
    p.add_argument("--factory", metavar="MODULE:NAME", help=FACTORY_HELP)
    p.set_defaults(optimizer=None, run=_export)
    p.set_defaults(defaults=vars(p.parse_args([])))


def _given(args: argparse.Namespace) -> list[str]:
    """The options given on the command line (those that differ from their defaults)."""
    defaults: dict[str, Any] = args.defaults
    return [
        k for k, v in vars(args).items() if k in defaults and k not in _ALWAYS and v != defaults[k]
    ]


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def _check_options(args: argparse.Namespace, kind: str) -> None:
    """One ``ExportError`` naming the options that do not go with this kind of source."""
    if args.layouts is not None and args.target != "c":
        raise ExportError(f"export: --layouts goes with --target c, not --target {args.target}")
    given = _given(args)
    if kind == "run":
        bad = [k for k in given if k not in _RUN_OPTIONS]
        why = "a run folder brings its own recipe, data and options"
    elif "factory" in given:
        bad = ["factory"]
        why = "it names the factory of a run folder's model (give --model module:name here)"
    elif kind == "finetune":
        bad = [k for k in given if k in _ONNX_MODEL_OPTIONS]
        why = "these apply to a workload or an .onnx model, not a fine-tune"
    else:
        allowed = {"scheme", "frozen_bn", *(("loss", "output", "optimizer", "lr")
                                            if kind == "onnx" else ())}  # fmt: skip
        bad = [k for k in given if k not in allowed]
        why = f"these apply to a fine-tune (--recipe or --model/--data), not to {args.source}"
    if bad:
        raise ExportError(f"export {args.source or ''}: {_flags(bad)}: {why}; drop them")


def _export(args: argparse.Namespace) -> int:
    """Prepare the step the arguments name, write it, and say what was written."""
    kind = _kind(args)
    _check_options(args, kind)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if kind in ("workload", "onnx"):
        return _export_model(args, kind)
    if args.target in ADAPTER_TARGETS or args.state:
        return _export_adapter(args, kind)
    run = Path(args.source) if kind == "run" else None
    out = _out_folder(args, f"train_step_{args.target}", run)
    prepared = _from_run(Path(args.source), args) if kind == "run" else _from_args(args)
    written = write_export(prepared, out, args.target, args.write_batches, args.layouts)
    folder = out.path
    print(f"wrote {folder}/ ({prepared.what}): {', '.join(written)}")
    print(f"see {folder / 'README.txt'} for how to run it")
    return 0


def _export_adapter(args: argparse.Namespace, kind: str) -> int:
    """A LoRA run's adapter, for llama.cpp (gguf-lora) or PEFT (peft)."""
    from pockengine.finetune.trained.gguf_lora import export_run_adapter

    if kind != "run" or args.target not in ADAPTER_TARGETS:
        raise ExportError(
            f"--target {args.target}{' --state' if args.state else ''}: "
            "--target gguf-lora or peft (with --state) takes a run folder of a "
            "--scheme lora fine-tune"
        )
    run = Path(args.source)
    out = _out_folder(args, "", run)
    with building(out) as tmp:
        written = export_run_adapter(
            run, tmp, args.target, Path(args.state) if args.state else None
        )
    print(f"wrote {out.path}/: {', '.join(written)} (the LoRA adapter of {run})")
    return 0


def _out_folder(args: argparse.Namespace, default: str, run: Path | None = None) -> OutFolder:
    """The export folder (``-o``, else ``RUN/export_<target>``, else ``default``), checked
    before any work: new, empty or an export (``out_folder.claim``; ``--force``: any). A
    folder named with ``-o`` may be a link to where it goes; one inside a run may not."""
    if args.out:
        given = Path(args.out)
        path, inside, option = (given.resolve() if given.is_symlink() else given), None, "-o"
    elif run is not None:
        path, inside, option = run / f"export_{args.target}", run, "the export folder"
    else:
        path, inside, option = Path(default), None, "the export folder"
    return claim(
        path, EXPORT, force=args.force, option=option, inside=inside, create=False, mark=False
    )


def _kind(args: argparse.Namespace) -> str:
    source = args.source
    if source is None:
        if not (args.recipe or args.model or args.data):
            raise ExportError(
                "export what? give a run folder, a workload (mlp, cnn, ...), a model.onnx, "
                "or --recipe / --model and --data as for pockengine finetune"
            )
        return "finetune"
    if source.endswith(".onnx"):
        return "onnx"
    path = Path(source)
    if path.is_dir():
        from pockengine.finetune.run_folder.checkpoint import CHECKPOINT

        adapter = args.target in ADAPTER_TARGETS and (path / "adapter").is_dir()
        if not (path / CHECKPOINT).is_file() and not adapter:
            raise ExportError(
                f"{source} is not a fine-tuning run folder: it has no {CHECKPOINT} "
                "(pockengine finetune --out FOLDER writes one at its first checkpoint)"
            )
        return "run"
    return "workload"


# -- preparing the step ----------------------------------------------------------------


def _from_args(args: argparse.Namespace) -> _Prepared:
    """The step ``pockengine finetune`` with these options would compile."""
    from pockengine.finetune.cli import config_from_args

    fixed = argparse.Namespace(**{**vars(args), "optimizer": args.optimizer or "adamw"})
    config = config_from_args(fixed)
    return _prepare(config, None, f"recipe {config.recipe}" if config.recipe else str(config.model))


def _from_run(run: Path, args: argparse.Namespace) -> _Prepared:
    """The step of the run in ``run``, holding its checkpoint's weights and optimizer state."""
    from pockengine.finetune.run_folder import checkpoint
    from pockengine.finetune.run_folder.run_meta import named_factory, names_factory

    path = run / checkpoint.CHECKPOINT
    saved = checkpoint.load(path)
    model = saved.config.get("model")
    if names_factory(model) or args.factory is not None:  # a run folder names no code to run
        named_factory(model if names_factory(model) else None, args.factory, path)
    try:
        config = FinetuneConfig(**{**saved.config, "backend": args.backend, "progress": "none"})
    except TypeError as exc:
        raise ExportError(
            f"{run}: the checkpoint's options do not fit this version: {exc}"
        ) from exc
    prepared = _prepare(config, saved.scheme, f"run {run} at step {saved.counters['step']}")
    checkpoint.load_into_step(prepared.step, saved, f"the model rebuilt from {path}")
    return prepared


def _prepare(config: FinetuneConfig, scheme: dict[str, Any] | None, what: str) -> _Prepared:
    """Fill in the recipe's defaults, build the task and compile its step, as a run does."""
    from pockengine.finetune.running import trainer
    from pockengine.sparse import schemes
    from pockengine.tasks import recipes

    config = config.validate()
    config = config.with_defaults(recipes.defaults(config, auto=False)).validate()
    assert config.scheme is not None, "filled in by the recipe's defaults"
    if scheme:  # a run's own scheme, as its checkpoint stored it
        parsed = schemes.from_dict(scheme)
    else:
        parsed = recipes.parse_scheme(config.scheme, recipes.recipe_name(config), config.batchnorm)
    recipes.check_model_files(config)
    task = recipes.build(config)
    step = trainer.compile_task(config, task, parsed)
    what = f"{what}, scheme {config.scheme}, {len(step.trained)} trained params"
    return _Prepared(step, what, config, task.train, task.labels, task.kind)


def _export_model(args: argparse.Namespace, kind: str) -> int:
    """A workload or an .onnx model, as ``pockengine export`` has always written them."""
    import pockengine as pe
    from pockengine.sparse.schemes import scheme_named

    folder_target = args.target in ("step", "c")
    out = _out_folder(args, f"train_step_{args.target}") if folder_target else None
    if kind == "onnx":
        scheme = scheme_named(args.scheme, frozen_bn=args.frozen_bn) if args.scheme else None
        lr = args.lr
        optimizer = (
            pe.optim.AdamW(lr=lr or 1e-3)
            if args.optimizer == "adamw"
            else pe.optim.SGD(lr=lr or 0.01, momentum=0.9)
        )
        output = int(args.output) if args.output and args.output.isdigit() else args.output
        step = pe.compile(
            args.source, loss=args.loss, output=output, optimizer=optimizer, scheme=scheme
        )
    else:
        from pockengine import zoo

        work, optimizer = zoo.benchmark(args.source)
        scheme = (
            scheme_named(
                args.scheme, sparse=zoo.workload_sparse(args.source), frozen_bn=args.frozen_bn
            )
            if args.scheme
            else None
        )
        step = pe.compile(
            work.model, work.loss_fn, work.make_batch(0), optimizer=optimizer, scheme=scheme
        )
    size = f"{len(step.graph.nodes)} nodes, {len(step.trained)} trained params"
    if out is not None:
        with building(out) as tmp:
            step.export(tmp, target=args.target, layouts=args.layouts)
        folder = out.path
    if args.target == "step":
        print(f"wrote {folder}/ ({size}); run it with pockengine.load_step({str(folder)!r})")
        return 0
    if args.target == "c":
        print(
            f"wrote {folder}/ ({size}); build it with `make -C {folder}` and run "
            f"{folder}/train X.npy Y.npy ..."
        )
        return 0
    path = args.out or "train_step.onnx"
    side = step.export(path)
    print(f"wrote {path} and {side} ({size}); run it with pockengine/ort_runner.py")
    return 0


# -- writing the folder ----------------------------------------------------------------


def batch_inputs(step: Any) -> list[Value]:
    """The step's batch inputs, in call order."""
    return list(step.graph.inputs_with_role(Role.INPUT))


def write_export(
    prepared: _Prepared,
    out: OutFolder,
    target: str,
    batches: int | None,
    layouts: str | None = None,
) -> list[str]:
    """Write the step to ``out`` for ``target``, the runner (onnx), ``README.txt`` and
    ``batches`` training batches, all in a folder beside it put in place at the end
    (``out_folder.building``: a failure leaves ``out`` as it was); returns the names
    written at the top of the folder. ``layouts``: for ``c``, a layout file
    (``step.export``)."""
    step = prepared.step
    trainer_notes = ""
    with building(out) as folder:
        if target == "c":
            step.export(folder, target="c", layouts=layouts)
            generic = folder / "README.md"  # the C trainer's own notes, folded into README.txt
            trainer_notes = generic.read_text()
            generic.unlink()
        elif target == "step":
            step.save(folder)
        else:
            step.export(folder / "train_step.onnx")
            # copied, not imported: the onnx runner needs onnxruntime, the export does not
            write_bytes(folder / "ort_runner.py", _ORT_RUNNER.read_bytes(), folder)
        files = _write_batches(prepared, folder, target, batches) if batches else []
        text = readme(prepared, target, files)
        if trainer_notes:
            text += f"\n\nThe trainer, as step.export describes it:\n\n{trainer_notes}"
        write_text(folder / "README.txt", text, folder)
        return sorted(p.name for p in folder.iterdir())


def _write_batches(prepared: _Prepared, folder: Path, target: str, count: int) -> list[str]:
    """The first ``count`` training batches in the order a run takes them (epoch 0),
    stacked along a new leading axis: ``batches.npz`` (onnx) or one ``.npy`` per input (c)."""
    from pockengine.tasks import data as ds

    config, values = prepared.config, batch_inputs(prepared.step)
    assert config is not None and config.batch_size is not None
    size, n = config.batch_size, len(prepared.train[0])
    if count * size > n:
        raise ExportError(
            f"--write-batches {count}: the training split has {n} examples, "
            f"{n // size} batches of {size}"
        )
    rows = ds.epoch_order(n, config.seed, 0)[: count * size]
    stacked = {
        v.name: np.ascontiguousarray(a[rows], dtype=v.dtype.to_numpy()).reshape(count, *v.shape)
        for v, a in zip(values, prepared.train, strict=True)
    }
    if target in ("onnx", "step"):
        write_with(folder / "batches.npz", lambda f: np.savez(f, **stacked), folder)  # type: ignore[arg-type]
        return ["batches.npz"]
    for name, array in stacked.items():
        write_with(folder / "batches" / f"{name}.npy", _npy_writer(array), folder)
    return [f"batches/{name}.npy" for name in stacked]


def _npy_writer(array: Array) -> Callable[[IO[bytes]], None]:
    return lambda f: np.save(f, array)


def _roles(prepared: _Prepared, count: int) -> list[str]:
    """What each batch input is, as the recipes build them."""
    if prepared.kind == "causal-lm":
        return ["token ids (the loss predicts each next token)"][:count]
    labels = ", ".join(f"{i}={name}" for i, name in enumerate(prepared.labels))
    inputs = {3: ["token ids", "attention mask (1 = token, 0 = padding)"], 2: ["images"]}
    return [*inputs.get(count, [f"model input {i}" for i in range(count - 1)]),
            f"label ids: {labels}"]  # fmt: skip


def readme(prepared: _Prepared, target: str, batch_files: list[str]) -> str:
    """How to run the exported step, and what its batch files hold."""
    values = batch_inputs(prepared.step)
    roles = _roles(prepared, len(values))
    layout = "\n".join(
        f"  {i}. {v.name:12s} {v.dtype.to_numpy().name:8s} shape {list(v.shape)}  ({role})"
        for i, (v, role) in enumerate(zip(values, roles, strict=True))
    )
    names = [v.name for v in values]
    if target == "onnx":
        run = (
            "python ort_runner.py train_step.onnx --batches batches.npz [--steps N] "
            "--save trained.safetensors"
        )
        files = (
            "batches.npz: one array per input, named as above, each with a leading axis "
            "of batches [B, *shape]; step k uses batch k modulo B"
        )
        needs = "needs numpy and onnxruntime (safetensors to save .safetensors)"
    elif target == "step":
        run = (
            "python -c \"import numpy as np, pockengine as pe; step = pe.load_step('.'); "
            "b = np.load('batches.npz'); "
            'print(step(*(b[n][0] for n in b.files)))"'
        )
        files = (
            "batches.npz: one array per input, named as above, each with a leading axis "
            "of batches [B, *shape]"
        )
        needs = "needs numpy and pockengine (and torch for a torch-backend step), no compiler"
    else:
        run = "make && ./train [--steps N] --save trained.safetensors " + " ".join(
            f"batches/{n}.npy" for n in names
        )
        files = (
            "one .npy file per input, in the order above, each one batch [*shape] or a "
            "stack of B batches [B, *shape] used in turn"
        )
        needs = "needs only a C compiler (make builds ./train, linked with libc and libm)"
    written = (
        "\n".join(f"  {f}" for f in batch_files)
        if batch_files
        else "  none: add --write-batches N to pockengine export to write some"
    )
    text = prepared.kind == "causal-lm" and values and len(values[0].shape) == 2
    own = _text_batches(values[0], target) if text else ""
    return f"""PockEngine training step: {prepared.what}.
Exported for target {target}; {needs}.

Run it:
  {run}

Batch inputs, in call order (dtype, shape of one batch):
{layout}

Batch files: {files}.
Written from the training data (the first batches of epoch 0, in a run's order):
{written}

The step runs at the learning rate it was exported with (a run's schedule is not applied).
{own}"""


def _text_batches(ids: Value, target: str) -> str:
    """How to make token-id batches of a causal LM's step from a text file."""
    batch, seq = ids.shape
    save = (
        "np.save('batches/" + ids.name + ".npy', ids)"
        if target == "c"
        else "np.savez('batches.npz', " + ids.name + "=ids)"
    )
    return f"""
Batches from your own text: tokenize it with the model's tokenizer (a run's RUN/model holds
it), cut the ids into rows of {seq} tokens and stack {batch} rows a batch, as int64
(`mkdir -p batches` first):

  python -c "import numpy as np; from transformers import AutoTokenizer; \\
    tok = AutoTokenizer.from_pretrained('RUN/model'); \\
    ids = tok(open('my.txt').read())['input_ids']; n = {batch} * {seq}; \\
    ids = np.array(ids[: len(ids) // n * n], dtype=np.int64).reshape(-1, {batch}, {seq}); \\
    {save}"

Every id must be below the model's vocabulary size (the step checks it before training).
"""
