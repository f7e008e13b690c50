"""ATen ops that common models use beyond the zoo: each converter (composed from IR ops)
gives torch.autograd's loss and gradients, on the NumPy reference and the other backends.

The modules are small stand-ins for what users bring: recurrent nets (bidirectional GRU
flips), group norm and transposed convolutions (U-Nets, detectors), resizing, leaky ReLU
and ELU, EmbeddingBag, and losses that reduce with argmax, max/min along a dim, variance,
products and norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pockengine as pe
from pockengine.ir import CompileError, DType, GraphBuilder, TensorType, UnsupportedOpError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cls(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


class _Head(nn.Module):
    """``body`` then global average pooling (images) and a linear head of 3 classes."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)
        return self.head(z.flatten(2).mean(2) if z.dim() > 2 else z)


class _Lambda(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor], *mods: nn.Module) -> None:
        super().__init__()
        self.fn, self.mods = fn, nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, *self.mods)


class _BiGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru = (
            nn.Embedding(40, 12),
            nn.GRU(12, 10, batch_first=True, bidirectional=True),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.emb(ids))
        return out.mean(1)


def _conv(cin: int = 3, cout: int = 8) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1)


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 10, 10, generator=g), torch.randint(0, 3, (2,), generator=g)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 40, (3, 6), generator=g), torch.randint(0, 3, (3,), generator=g)


def _image_case(fn: Callable[..., torch.Tensor], *mods: nn.Module, width: int = 8) -> Any:
    return lambda: (_Head(_Lambda(fn, *mods), width), _cls, _images())


CASES: dict[str, Callable[[], tuple[nn.Module, Any, tuple[torch.Tensor, ...]]]] = {
    "bidirectional-gru": lambda: (_Head(_BiGRU(), 20), _cls, _ids()),
    "group-norm": _image_case(lambda x, c, g: F.silu(g(c(x))), _conv(), nn.GroupNorm(4, 8)),
    "group-norm-no-affine": _image_case(
        lambda x, c, g: g(c(x)), _conv(), nn.GroupNorm(2, 8, affine=False)
    ),
    "adaptive-max-pool": _image_case(lambda x, c: F.adaptive_max_pool2d(c(x), 5), _conv()),
    "leaky-relu-elu": _image_case(
        lambda x, c: F.elu(F.leaky_relu(c(x), 0.2), alpha=0.7) + F.selu(c(x)), _conv()
    ),
    "conv-transpose": _image_case(
        lambda x, c, t: t(F.relu(c(x))),
        _conv(),
        nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1),
        width=6,
    ),
    "conv-transpose-groups-dilation": _image_case(
        lambda x, t: t(x), nn.ConvTranspose2d(3, 6, 3, stride=2, groups=3, dilation=2), width=6
    ),
    "conv-transpose-1d": lambda: (
        _Head(_Lambda(lambda x, t: t(x.flatten(2)), nn.ConvTranspose1d(3, 4, 4, stride=2)), 4),
        _cls,
        _images(),
    ),
    "nearest-x2": _image_case(
        lambda x, c: F.interpolate(c(x), scale_factor=2, mode="nearest") * c(x).repeat(1, 1, 2, 2),
        _conv(),
    ),
    "nearest-size": _image_case(
        lambda x, c: F.interpolate(c(x), size=(7, 13), mode="nearest"), _conv()
    ),
    "nearest-exact-half": _image_case(
        lambda x, c: F.interpolate(c(x), scale_factor=0.5, mode="nearest-exact"), _conv()
    ),
    "nearest-half": _image_case(
        lambda x, c: F.interpolate(c(x), scale_factor=0.5, mode="nearest"), _conv()
    ),
    "bilinear": _image_case(
        lambda x, c: F.interpolate(c(x), size=(15, 7), mode="bilinear", align_corners=False),
        _conv(),
    ),
    "bilinear-align-x2": _image_case(
        lambda x, c: F.interpolate(c(x), scale_factor=2, mode="bilinear", align_corners=True),
        _conv(),
    ),
    "flip-roll-index-select": _image_case(
        lambda x, c: (
            torch.roll(c(x).flip(3), shifts=(2, -1), dims=(2, 3)).index_select(
                1, torch.tensor([0, 5, 5, 2])
            )
            + torch.roll(c(x)[:, :4], 7)
        ),
        _conv(),
        width=4,
    ),
    "embedding-bag": lambda: (
        _Head(nn.EmbeddingBag(40, 8, mode="mean", padding_idx=0), 8),
        _cls,
        _ids(),
    ),
    "embedding-bag-max": lambda: (_Head(nn.EmbeddingBag(40, 8, mode="max"), 8), _cls, _ids()),
}


def _losses() -> dict[str, Callable[..., torch.Tensor]]:
    def logits(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    return {
        "argmax-nll": lambda m, x, y: (
            F.nll_loss(F.log_softmax(logits(m, x), -1), logits(m, x).argmin(-1))
            + F.cross_entropy(logits(m, x), y, label_smoothing=0.1)
        ),
        "max-min-dim": lambda m, x, y: (
            logits(m, x).max(1).values.sum()
            - logits(m, x).min(0)[0].mean()
            + logits(m, x).amin().abs()
            + logits(m, x).max()
        ),
        "var-std": lambda m, x, y: (
            logits(m, x).var(1).mean()
            + logits(m, x).std(0).mean()
            + torch.var_mean(logits(m, x), 1, correction=0)[0].sum()
        ),
        "prod": lambda m, x, y: logits(m, x).sigmoid().prod(1).mean() + logits(m, x).prod(),
        "norms": lambda m, x, y: (
            F.cosine_similarity(logits(m, x), logits(m, x).flip(0)).mean()
            + torch.linalg.vector_norm(logits(m, x), ord=3, dim=1).sum()
            + torch.linalg.vector_norm(logits(m, x), ord=float("inf"))
            + logits(m, x).norm(p=1)
        ),
        "kl-isnan-clamp": lambda m, x, y: (
            F.kl_div(
                F.log_softmax(logits(m, x), -1), F.softmax(x[:, :3], -1), reduction="batchmean"
            )
            + torch.clamp(logits(m, x), min=x[:, :3] - 0.5, max=x[:, 3:6]).sum()
        ),
        "triu-of-a-product": lambda m, x, y: torch.triu(logits(m, x).T @ logits(m, x)).sum(),
    }


LOSSES = _losses()


def _linear_case(loss: Callable[..., torch.Tensor]) -> tuple[nn.Module, Any, Any]:
    g = torch.Generator().manual_seed(0)
    return nn.Linear(8, 3), loss, (torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,)))


def _check(model: nn.Module, loss_fn: Any, batch: tuple[torch.Tensor, ...], backend: str) -> None:
    ref_model = model
    ref_model.zero_grad()
    ref_loss = loss_fn(ref_model, *batch)
    expected = float(ref_loss.detach())
    ref_loss.backward()
    ref = {n: p.grad.numpy().copy() for n, p in ref_model.named_parameters()}
    step = pe.compile(model, loss_fn, batch, optimizer=pe.optim.SGD(lr=0.0), backend=backend)
    got = step.gradients(*batch)
    assert set(got) == set(ref)
    scale = max(float(np.abs(g).max()) for g in ref.values())
    # float32 sums in another order (ATen's and NumPy's kernels, whose split depends on the
    # threads free at the time) differ by up to about 1.2e-6 of the largest gradient
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=4e-6 * max(scale, 1.0),
                                   err_msg=name)  # fmt: skip
    loss = step(*batch)
    assert abs(loss - expected) <= 1e-5 * (1 + abs(expected))


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_gradients_match_autograd(name: str) -> None:
    torch.manual_seed(0)
    model, loss_fn, batch = CASES[name]()
    _check(model, loss_fn, batch, "numpy")


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_gradients_match_autograd(name: str) -> None:
    torch.manual_seed(0)
    _check(*_linear_case(LOSSES[name]), "numpy")


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize(
    "name", ["group-norm", "conv-transpose", "nearest-size", "bilinear", "embedding-bag"]
)
def test_other_backends_match_autograd(name: str, backend: str) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model, loss_fn, batch = CASES[name]()
    _check(model, loss_fn, batch, backend)


@pytest.mark.parametrize("name", ["group-norm", "conv-transpose", "nearest-x2", "embedding-bag"])
def test_c_backend_matches_autograd(name: str) -> None:
    torch.manual_seed(0)
    model, loss_fn, batch = CASES[name]()
    _check(model, loss_fn, batch, "c")


def test_c_backend_claims_only_what_its_kernels_take() -> None:
    """Resizing to an odd size computes i64 source indices; the C kernels of ``minimum``
    take floats, so the C backend names those nodes instead of failing while emitting."""
    torch.manual_seed(0)
    model, loss_fn, batch = CASES["nearest-size"]()
    with pytest.raises(UnsupportedOpError, match="minimum on i64"):
        pe.compile(model, loss_fn, batch, backend="c")


def test_argmax_takes_the_first_of_equal_maxima() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    m = nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.copy_(torch.eye(4))
        m.bias.zero_()

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        z = model(x)
        return (z.argmax(1) * 10 + z.argmin(1)).float().sum() + z.sum() * 0

    step = pe.compile(m, loss, (x,), optimizer=pe.optim.SGD(lr=0.0))
    assert step(x) == float(loss(m, x)) == 34  # 1*10+3, 0*10+0 and 2*10+1


def test_unsupported_shapes_are_named() -> None:
    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.adaptive_max_pool2d(x, 3)

    x, y = torch.randn(2, 3, 10, 10), torch.randint(0, 3, (2,))
    with pytest.raises(CompileError, match="adaptive max pooling of 10x10 to 3x3"):
        pe.compile(_Head(Pool(), 3), _cls, (x, y))

    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(40, 3)

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.bag(ids, offsets)

    ids, offsets = torch.randint(0, 40, (10,)), torch.tensor([0, 4])
    with pytest.raises(CompileError, match="at bag: EmbeddingBag needs a 2-D input"):
        pe.compile(Bags(), lambda m, i, o: m(i, o).sum(), (ids, offsets))


def test_a_rewrite_never_gives_a_new_node_a_name_it_copies_later() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2,), DType.F32))
    y = b.call("neg", x)
    z = b.call("exp", y)
    graph = b.build([z])
    r = GraphBuilder.rewriting(graph)
    made = [r.call("neg", x) for _ in range(4)]  # fresh names, made before the copies
    for node in graph.nodes:
        r.append(node)  # would raise "value name ... is used twice" on a collision
    names = [v.name for v in made] + [n.output.name for n in graph.nodes]
    assert len(set(names)) == len(names)


class _StochasticDepth(nn.Module):
    """A residual branch dropped per sample with probability 0.25 (timm's drop_path)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.75
        mask = x.new_empty((x.shape[0], 1)).bernoulli_(keep) / keep
        return x + self.branch(x) * mask if self.training else x + self.branch(x)


def test_stochastic_depth_draws_a_new_per_sample_mask_each_step() -> None:
    torch.manual_seed(0)
    model = _StochasticDepth()
    x = torch.randn(4096, 8)

    def kept(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) != x).float().mean()  # the fraction of samples whose branch was kept

    step = pe.compile(model, kept, (x,), optimizer=pe.optim.SGD(lr=0.0))
    fractions = [step(x) for _ in range(3)]
    assert len(set(fractions)) == 3  # a new mask every step
    assert all(abs(f - 0.75) < 0.03 for f in fractions)
    model.eval()  # in eval mode the branch always counts: autograd's gradients
    _check(model, lambda m, x, y: F.cross_entropy(m(x)[:, :3], y), (x[:16], torch.zeros(16,
           dtype=torch.long)), "numpy")  # fmt: skip
