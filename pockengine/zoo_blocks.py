"""Small models of the blocks that some architectures add to the zoo's (``zoo.py``):
learned positions looked up with ``arange`` (GPT-2, Whisper), a mixture-of-experts layer
with a top-k router (Mixtral, Qwen-MoE) and patches folded back with ``F.fold`` (MobileViT).

Each factory returns a ``zoo.Workload``; the tests check their gradients against
torch.autograd and train them a few steps on every backend. Needs torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pockengine.zoo import Workload

__all__ = ["fold_vit", "gpt2_lm", "moe_classifier"]


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _inputs(
    make_x: Callable[[torch.Generator], torch.Tensor], batch: int, classes: int
) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return make_x(g), torch.randint(0, classes, (batch,), generator=g)

    return make


# -- GPT-2: learned positions, tied head -----------------------------------------------------


class _Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, as GPT-2's block."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln_2(x))))
        return out


class GPT2(nn.Module):
    """Token and learned position embeddings (``wpe(arange(t))``), blocks, a tied head."""

    def __init__(self, vocab: int, context: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(context, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _next_token(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2_lm(
    vocab: int = 64,
    context: int = 32,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seq: int = 16,
    batch: int = 2,
) -> Workload:
    """A GPT-2-style causal LM (next-token cross-entropy on ``seq`` of ``context`` positions)."""
    torch.manual_seed(0)
    model = GPT2(vocab, context, hidden, heads, layers)

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return Workload("gpt2", model, _next_token, make)


# -- mixture of experts: a top-k router --------------------------------------------------------


class MoE(nn.Module):
    """Each token goes to its ``k`` best experts (of a linear router), weighted by the softmax
    of their router logits; every expert runs on every token (static shapes) and the picked
    ones are gathered, so the router trains through the top-k values."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, chosen = torch.topk(self.router(x), self.k, dim=-1)  # [..., k]
        weights = logits.softmax(dim=-1)
        outs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [..., E, hidden]
        index = chosen.unsqueeze(-1).expand(*chosen.shape, x.shape[-1])
        picked = torch.gather(outs, -2, index)  # [..., k, hidden]
        return x + (weights.unsqueeze(-1) * picked).sum(dim=-2)


class MoEClassifier(nn.Module):
    def __init__(self, vocab: int, hidden: int, experts: int, k: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, experts, k)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.moe(self.norm(self.embed(ids)))
        logits: torch.Tensor = self.head(h.mean(dim=1))
        return logits


def moe_classifier(
    vocab: int = 50,
    hidden: int = 16,
    experts: int = 4,
    k: int = 2,
    seq: int = 6,
    batch: int = 3,
    classes: int = 3,
) -> Workload:
    """Token classifier over a mixture-of-experts layer with a top-``k`` router."""
    torch.manual_seed(0)
    model = MoEClassifier(vocab, hidden, experts, k, classes)
    make = _inputs(lambda g: torch.randint(0, vocab, (batch, seq), generator=g), batch, classes)
    return Workload("moe", model, _classify, make)


# -- F.fold: a mobile-ViT-style patch mixer ----------------------------------------------------


class FoldViT(nn.Module):
    """Conv stem, then MobileViT v2's unfold -> mix across patches -> fold: ``F.unfold``
    cuts ``patch`` x ``patch`` windows at ``stride``, a linear layer and attention mix the
    windows, ``F.fold`` sums them back into the image (overlapping windows add up)."""

    def __init__(self, channels: int, size: int, patch: int, stride: int, classes: int) -> None:
        super().__init__()
        self.size, self.patch, self.stride = size, patch, stride
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        width = channels * patch * patch
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.stem(x))
        windows = F.unfold(h, self.patch, stride=self.stride).transpose(1, 2)  # [B, L, C*p*p]
        z = self.norm(windows)
        z = windows + self.attn(z, z, z, need_weights=False)[0]
        z = self.mix(z).transpose(1, 2)
        folded = F.fold(z, (self.size, self.size), self.patch, stride=self.stride)
        logits: torch.Tensor = self.head((h + folded).mean(dim=(2, 3)))
        return logits


def fold_vit(
    channels: int = 4,
    size: int = 8,
    patch: int = 2,
    stride: int = 1,
    batch: int = 2,
    classes: int = 3,
) -> Workload:
    """Image classifier with an unfold/fold patch mixer (``stride < patch``: windows overlap)."""
    torch.manual_seed(0)
    model = FoldViT(channels, size, patch, stride, classes)
    make = _inputs(lambda g: torch.randn(batch, 3, size, size, generator=g), batch, classes)
    return Workload("fold-vit", model, _classify, make)
