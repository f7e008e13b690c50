"""What a fine-tuning run is: its options, their checks, and its error class.

``FinetuneConfig`` holds every option of ``pe.finetune`` and ``pockengine finetune``.
Options left ``None`` take the recipe's default (``recipes.defaults``). The options
that define the training itself (``TRAINING_FIELDS``) are stored in each checkpoint;
``--resume`` insists they are unchanged, since changing one would not continue the
run but start a different one. The others only steer this invocation.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from pockengine.backends import BACKENDS
from pockengine.ir import PockEngineError
from pockengine.optim import SGD, AdamW, Optimizer

__all__ = [
    "DATA_FORMATS",
    "DEFAULT_BACKEND",
    "DEFAULT_RECIPE",
    "FROZEN_DTYPE_CHOICES",
    "OPTIMIZER_STATE_CHOICES",
    "RUN_FIELDS",
    "TASK_CHOICES",
    "FinetuneConfig",
    "FinetuneError",
]

# The backend fine-tuning compiles for unless told otherwise: the ATen backend, which the
# tests hold to the NumPy reference (the oracle, not the fast path).
DEFAULT_BACKEND = "torch"
DEFAULT_RECIPE = "minilm-bbc"
# How frozen weights are stored in the step: float, int8, int4, or a GGUF recipe's blocks.
FROZEN_DTYPE_CHOICES = ("none", "int8", "int4", "gguf")
# How AdamW stores its moments: float32, or bytes with a scale per block (docs/quant.md).
OPTIMIZER_STATE_CHOICES = ("float32", "int8")
AUTO_SCORES = ("fisher", "taylor", "grad")  # estimate.SCORES (config imports no estimate)
# How a trained BatchNorm normalises: by the batch, or by its running statistics as the
# frozen ones do (schemes.BATCHNORM_MODES; docs/quality.md, lite0-fashion).
BATCHNORM_CHOICES = ("batch", "running")
TASK_CHOICES = ("lm", "classify")  # what --model/--data trains (None: from the model)
DATA_FORMATS = ("text", "completion", "alpaca", "chat")  # lm_data.FORMATS

# Options that steer one invocation and may differ between a run and its resume.
RUN_FIELDS = frozenset(
    {
        "out",
        "resume",
        "max_steps",
        "checkpoint_every",
        "log_every",
        "progress",
        "backend",
        "encoding",  # the data's fingerprint is checked on resume instead
        "keep",  # which weights RUN/model holds; written at the end of each invocation
        "remat_budget",  # recomputation changes no bit of the results, only memory and time
        "compile_in",  # where the step is compiled: the same step either way
        "force",  # write into a folder that is not a run (only the run's files replaced)
    }
)


class FinetuneError(PockEngineError):
    """A fine-tuning run that cannot start or go on: a missing package, a bad dataset
    or option, a checkpoint that does not fit. The message says what to do."""


@dataclass
class FinetuneConfig:
    """Every option of a fine-tuning run (``None``: the recipe's default)."""

    recipe: str | None = DEFAULT_RECIPE  # None: the generic path (model + data)
    model: str | None = None  # a Hugging Face model folder or "module:factory"
    data: str | None = None  # a CSV, a JSONL file or a folder of class subfolders
    text_column: str = "text"
    label_column: str = "label"
    tokenizer: str | None = None  # a Hugging Face tokenizer folder (factory models, or
    # a model folder without one)
    encoding: str = "utf-8"  # of the --data text files
    scheme: str | None = None  # auto, full, bias, sparse, head, last:K or a scheme file
    memory_budget: float | None = None  # auto: planned-peak bytes (None: sparse's peak)
    auto_score: str = "fisher"  # auto: what ranks the weights (fisher, taylor or grad)
    batchnorm: str | None = None  # trained BatchNorms on batch or running statistics
    remat_budget: float | None = None  # planned-peak bytes met by recomputation (0: off)
    optimizer: str = "adamw"  # adamw or sgd
    lr: float | None = None
    weight_decay: float = 0.01
    momentum: float = 0.9  # sgd only
    optimizer_state: str = "float32"  # adamw's moments: float32 or int8 (block-wise)
    epochs: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None  # text: tokens per example
    image_size: int | None = None  # images: side in pixels
    warmup: float = 0.1  # fraction of all steps with a linearly rising learning rate
    val_fraction: float = 0.2
    test_fraction: float = 0.0  # of the validation split, held out as a test split
    max_train: int | None = None  # use at most this many training examples
    max_val: int | None = None
    dedupe: bool = True  # drop exact duplicate texts before splitting
    seed: int = 0
    backend: str = DEFAULT_BACKEND
    frozen_dtype: str = "none"  # none, int8, int4, gguf (docs/quant.md)
    out: str | None = None  # None: runs/<recipe or model name>
    resume: bool = False
    max_steps: int | None = None  # stop (with a checkpoint) after this many steps in all
    checkpoint_every: int = 50  # steps; each epoch's end is a checkpoint too
    log_every: int = 10  # steps per metrics line
    progress: str = "auto"  # auto (tqdm if installed), plain, none
    keep: str = "best"  # RUN/model: the best validation's weights (ties: latest) or the last
    compile_in: str = "child"  # child: compile in a child, train its artifact; or process
    force: bool = False  # --out may be a folder that is not a run (out_folder.claim)
    task: str | None = None  # lm or classify (None: a causal-LM model trains as one)
    data_format: str | None = None  # causal LM: text, completion, alpaca, chat (None: detected)
    train_on_prompt: bool = False  # causal LM: the loss covers the prompt tokens too
    packing: str = "on"  # causal LM: examples packed into rows, or "off": one a row
    buckets: int = 16  # causal LM, packing off: at most this many row lengths (lm_buckets)
    truncate: bool = True  # causal LM: cut an example longer than seq_len (False: refuse it)

    def make_optimizer(self, lr: float | None = None) -> Optimizer:
        """The run's optimizer at ``lr`` (default: the config's): SGD with its momentum, or
        AdamW with its moments stored as ``optimizer_state`` says; the weight decay."""
        rate = float(self.lr or 0.0) if lr is None else float(lr)
        if self.optimizer == "sgd":
            return SGD(lr=rate, momentum=self.momentum, weight_decay=self.weight_decay)
        return AdamW(lr=rate, weight_decay=self.weight_decay, state_dtype=self.optimizer_state)

    def validate(self) -> FinetuneConfig:
        """``self`` if every option is in range, else a ``FinetuneError`` naming it."""
        _numbers(self)
        if self.recipe is None and (self.model is None or self.data is None):
            raise FinetuneError("without a recipe, give both a model and a dataset")
        _choice("optimizer", self.optimizer, ("adamw", "sgd"))
        _choice("optimizer_state", self.optimizer_state, OPTIMIZER_STATE_CHOICES)
        if self.optimizer_state != "float32" and self.optimizer != "adamw":
            raise FinetuneError(
                f"optimizer_state={self.optimizer_state!r} needs the adamw "
                f"optimizer, got {self.optimizer!r}"
            )
        _choice("backend", self.backend, (*BACKENDS, "torch-cpu"))
        _choice("frozen_dtype", self.frozen_dtype, FROZEN_DTYPE_CHOICES)
        _choice("progress", self.progress, ("auto", "plain", "none"))
        _choice("keep", self.keep, ("best", "last"))
        _choice("compile_in", self.compile_in, ("process", "child"))
        _choice("auto_score", self.auto_score, AUTO_SCORES)
        if self.batchnorm is not None:
            _choice("batchnorm", self.batchnorm, BATCHNORM_CHOICES)
        if self.task is not None:
            _choice("task", self.task, TASK_CHOICES)
        if self.data_format is not None:
            _choice("data_format", self.data_format, DATA_FORMATS)
        _choice("packing", self.packing, ("on", "off"))
        for name in (
            "epochs",
            "batch_size",
            "seq_len",
            "image_size",
            "max_train",
            "max_val",
            "max_steps",
            "buckets",
            "checkpoint_every",
            "log_every",
        ):
            _positive(name, getattr(self, name))
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise FinetuneError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise FinetuneError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay}"
            )
        if not 0 <= self.momentum < 1:
            raise FinetuneError(f"momentum must be in [0, 1), got {self.momentum}")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise FinetuneError(f"unknown text encoding {self.encoding!r}") from None
        if not 0 <= self.warmup < 1:
            raise FinetuneError(f"warmup is a fraction of all steps in [0, 1), got {self.warmup}")
        if not 0 < self.val_fraction < 1:
            raise FinetuneError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 0 <= self.test_fraction < 1:
            raise FinetuneError(f"test_fraction must be in [0, 1), got {self.test_fraction}")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise FinetuneError(f"memory_budget must be > 0 bytes, got {self.memory_budget}")
        if self.remat_budget is not None and not self.remat_budget >= 0:
            raise FinetuneError(
                f"remat_budget must be >= 0 bytes (0: none), got {self.remat_budget}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def training_dict(self) -> dict[str, Any]:
        """The options that define the training (stored in checkpoints)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUN_FIELDS}

    def with_defaults(self, defaults: dict[str, Any]) -> FinetuneConfig:
        """A copy whose ``None`` options are taken from ``defaults``."""
        fill = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **fill)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FinetuneError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FinetuneError(f"{name} must be a positive integer, got {value!r}")


def _numbers(config: FinetuneConfig) -> None:
    """The float options are numbers and the text options text (the API takes any value)."""
    for name in (
        "lr",
        "weight_decay",
        "momentum",
        "warmup",
        "val_fraction",
        "test_fraction",
        "memory_budget",
        "remat_budget",
    ):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise FinetuneError(f"{name} must be a number, got {value!r}")
    for name in (
        "recipe",
        "model",
        "data",
        "tokenizer",
        "scheme",
        "out",
        "backend",
        "encoding",
        "frozen_dtype",
        "optimizer_state",
        "auto_score",
        "batchnorm",
        "task",
        "data_format",
        "packing",
    ):
        value = getattr(config, name)
        if value is not None and not isinstance(value, str | os.PathLike):
            raise FinetuneError(f"{name} must be a string, got {value!r}")
