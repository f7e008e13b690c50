"""Datasets, splits, data order, tokenisation, the schedule and the options."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pockengine as pe
from pockengine.finetune import FinetuneConfig, FinetuneError
from pockengine.optim import linear_schedule
from pockengine.tasks import data as ds
from pockengine.tasks.recipes import RECIPES, bbc_folder, parse_scheme


def test_bbc_news_layout_and_duplicates() -> None:
    news = ds.load_folder(bbc_folder(), replace=True)  # as the recipe reads it
    assert len(news) == 2225 and news.replaced > 0  # a few pound signs in Latin-1
    assert news.label_names() == ("business", "entertainment", "politics", "sports", "tech")
    unique, dropped = ds.dedupe(news)
    assert dropped == 98 and len(set(unique.texts)) == len(unique) == 2127


def _toy(n: int = 100) -> ds.TextDataset:
    labels = tuple("abc"[i % 3] if i < 90 else "c" for i in range(n))
    return ds.TextDataset(tuple(f"text {i}" for i in range(n)), labels, "toy")


def test_split_is_stratified_seeded_and_disjoint() -> None:
    data = _toy()
    train, val = ds.split(data, 0.2, seed=3)
    assert set(train.texts).isdisjoint(val.texts) and len(train) + len(val) == len(data)
    assert Counter(val.labels) == {"a": 6, "b": 6, "c": 8}
    again = ds.split(data, 0.2, seed=3)
    assert again == (train, val)
    assert ds.split(data, 0.2, seed=4)[1].texts != val.texts


def test_epoch_order_is_a_pure_function_of_seed_and_epoch() -> None:
    first = ds.epoch_order(50, seed=0, epoch=0)
    assert sorted(first.tolist()) == list(range(50))
    np.testing.assert_array_equal(first, ds.epoch_order(50, seed=0, epoch=0))
    assert not np.array_equal(first, ds.epoch_order(50, seed=0, epoch=1))


def test_word_tokenizer_pads_truncates_and_marks_unknowns() -> None:
    tok = ds.WordTokenizer.fit(["the cat sat", "the dog"], max_vocab=3)
    assert tok.vocab == ("the", "cat", "dog") and tok.vocab_size == 5
    ids, mask = tok.encode(["The cat flew away home", ""], seq_len=4)
    assert ids.tolist() == [[2, 3, 1, 1], [0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]


def test_csv_with_quoted_commas_and_newlines(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text('id,text,label\n1,"hello, world\nagain",x\n2,plain,y\n')
    data = ds.load_dataset(path)
    assert data.texts == ("hello, world\nagain", "plain") and data.labels == ("x", "y")


def test_jsonl_and_folder(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n\n{"text": "b", "label": 2}\n')
    assert ds.load_dataset(path).labels == ("1", "2")
    for label, text in (("neg", "bad"), ("pos", "good")):
        (tmp_path / "f" / label).mkdir(parents=True)
        (tmp_path / "f" / label / "1.txt").write_bytes(text.encode() + b"\xff")
    with pytest.raises(FinetuneError, match=r"neg/1\.txt:1: not utf-8"):
        ds.load_dataset(tmp_path / "f")
    folder = ds.load_dataset(tmp_path / "f", encoding="latin-1")
    assert folder.labels == ("neg", "pos") and folder.texts[0] == "bad\xff"
    replaced = ds.load_folder(tmp_path / "f", replace=True)
    assert replaced.texts[0] == "bad\ufffd" and replaced.replaced == 2


def test_linear_warmup_then_decay() -> None:
    lrs = [linear_schedule(t, 1.0, warmup=4, total=20) for t in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in itertools.pairwise(lrs[3:])) and lrs[-1] > 0
    assert linear_schedule(20, 1.0, warmup=4, total=20) == 0.0


def test_scheme_names() -> None:
    assert parse_scheme("last:3").to_dict() == {
        "scheme": "last_blocks",
        "k": 3,
        "head": True,
        "frozen_bn": "eval",
    }
    bias = parse_scheme("bias").to_dict()
    assert bias == {
        "scheme": "sparse",
        "bias": "all",
        "blocks": 0,
        "head": True,
        "frozen_bn": "eval",
    }
    with pytest.raises(FinetuneError, match="whole number"):
        parse_scheme("last:x")


def test_options_are_checked() -> None:
    with pytest.raises(FinetuneError, match="unknown finetune options \\['learning_rate'\\]"):
        pe.finetune(learning_rate=0.1)
    with pytest.raises(FinetuneError, match="optimizer must be one of adamw, sgd"):
        FinetuneConfig(optimizer="adam").validate()
    with pytest.raises(FinetuneError, match="epochs must be a positive integer"):
        FinetuneConfig(epochs=0).validate()
    with pytest.raises(FinetuneError, match="brings its own model and data"):
        pe.finetune(recipe="minilm-bbc", data="x.csv")


def test_idx_reader_and_image_preprocessing(tmp_path: Path) -> None:
    import gzip

    from pockengine.tasks import vision

    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in images.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.tobytes()))
    np.testing.assert_array_equal(vision.load_idx(path), images)
    x = vision.preprocess(images, 56)
    assert x.shape == (2, 3, 56, 56) and x.dtype == np.float32
    np.testing.assert_array_equal(x[:, 0], x[:, 2])
    assert x.min() >= -1 and x.max() <= 1
    # chunked (vision._CHUNK images at a time): the same bits as the whole batch at once
    many = np.random.default_rng(0).integers(0, 256, (vision._CHUNK + 44, 28, 28), np.uint8)
    t = torch.nn.functional.interpolate(
        torch.from_numpy(many.astype(np.float32))[:, None],
        size=(40, 40),
        mode="bilinear",
        align_corners=False,
    )
    want = ((t - 127.0) / 128.0).expand(-1, 3, -1, -1).numpy()  # fmt: skip
    np.testing.assert_array_equal(vision.preprocess(many, 40), want)
    path.write_bytes(b"not idx")
    with pytest.raises(FinetuneError, match="not an IDX file"):
        vision.load_idx(path)


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_causal_lm_chunks_join_documents_with_end_of_text() -> None:
    from pockengine.tasks.causal_lm import pack, split_docs

    chunks = pack(_CharTokenizer(), ["abc", "defgh", "ij"], seq_len=4, limit=None)
    assert chunks.tolist() == [[97, 98, 99, 0], [100, 101, 102, 103], [104, 0, 105, 106]]
    assert pack(_CharTokenizer(), ["abc", "defgh", "ij"], seq_len=4, limit=1).shape == (1, 4)
    train, val = split_docs(10, 0.2, seed=0)
    assert sorted([*train, *val]) == list(range(10)) and len(val) == 2


def test_llm_recipe_trains_norms_and_output_projections_of_every_block() -> None:
    from pockengine import zoo
    from pockengine.frontend.torch import torch_model_info
    from pockengine.sparse.schemes import resolve_scheme

    model = zoo.llama_lm().model
    trained = resolve_scheme(parse_scheme("sparse", "smollm2-pydocs"), torch_model_info(model))
    layers = model.config.num_hidden_layers
    want = {n for n, _ in model.named_parameters() if "norm" in n}
    for i in range(layers):
        want |= {
            f"model.layers.{i}.mlp.down_proj.weight",
            f"model.layers.{i}.self_attn.o_proj.weight",
        }
    assert trained.names == want
    # other recipes keep the PockEngine recipe of biases, norms and the last blocks
    assert parse_scheme("sparse", "minilm-bbc").to_dict()["scheme"] == "sparse"


def test_learning_rate_defaults_by_recipe_and_scheme() -> None:
    from pockengine.tasks.recipes import defaults

    def lr(**kw: Any) -> float:
        return float(defaults(FinetuneConfig(**kw))["lr"])

    assert lr(recipe="minilm-bbc", scheme="full") == 1e-4
    assert lr(recipe="minilm-bbc", scheme="head") == 1e-2
    assert lr(recipe="minilm-bbc", scheme="last:3") == 5e-4
    assert lr(recipe="minilm-bbc", scheme="head", optimizer="sgd") == pytest.approx(0.1)
    table = RECIPES["smollm2-pydocs"].lr  # the LLM recipe's own, by scheme
    for scheme in ("full", "sparse", "bias", "head"):
        assert lr(recipe="smollm2-pydocs", scheme=scheme) == table[scheme]
    assert lr(recipe="smollm2-pydocs", scheme="last:4") == 5e-4  # not in it: the general one


def _old_fingerprint(*arrays: np.ndarray) -> str:
    """The definition the caches and checkpoints were written with: sha256 of the shape,
    dtype and C-order bytes of each array."""
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def test_fingerprint_hashes_the_bytes_in_c_order_without_copying_them() -> None:
    """Views are hashed in place, other layouts a few MiB at a time: the same hash as the
    C-order bytes (saved checkpoints and analysis caches keep matching), and no copy of
    the whole array (it was one: 98 MiB for lite0-fashion's images)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    images = rng.standard_normal((64, 3, 8, 8), dtype=np.float32)
    cases = [
        (images, rng.integers(0, 9, 64)),
        (images.transpose(0, 2, 3, 1),),  # not contiguous
        (images[::2], images[:, 1]),  # strided rows; a strided axis
        (rng.random(10) > 0.5, np.array(3.0), np.zeros((0, 4), np.int64)),
    ]
    for arrays in cases:
        assert ds.fingerprint(*arrays) == _old_fingerprint(*arrays)
    assert ds.fingerprint(images) != ds.fingerprint(images.reshape(64, -1))  # shape counts
    big = np.ones((256, 64 << 10), np.float32)  # 64 MiB
    peaks = []
    for a in (big, big[:, ::2]):  # strided: 32 MiB of data, copied a few MiB at a time
        tracemalloc.start()
        try:
            ds.fingerprint(a)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[0] < 1 << 20 and peaks[1] < 12 << 20
