"""The same small networks written in PyTorch, JAX (flax.linen) and Keras, with identical
weights, compile to training steps that agree: per layer the same forward and backward
FLOPs in ``step.report()``, the same trained-parameter count and the same first loss,
under full backprop and two sparse schemes.

Each frontend lowers its own loss (``F.cross_entropy``; optax's log-softmax with a stopped
max; Keras's named loss), so the loss rows are left out of the FLOPs. BatchNorm in training
mode is one ``batch_norm`` op and the running-statistics updates in all three (Flax's
lowered whole by ``frontend/jax/flax.py``), so its row is compared like the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pockengine as pe  # noqa: E402
from pockengine.ir import Phase  # noqa: E402
from pockengine.plan.report import Figures  # noqa: E402
from pockengine.sparse import schemes  # noqa: E402

Array = np.ndarray[Any, Any]
LOSS_ROWS = {"<loss_fn>", "loss"}  # torch and JAX (loss_fn's own code), Keras (named loss)


@dataclass
class Triple:
    """One network in the three frameworks, and each report row's canonical layer name."""

    torch_model: Any
    jax_variables: Any
    jax_loss: Callable[..., Any]
    keras_model: Any
    batch_nchw: tuple[Array, Array]  # (x, labels) for PyTorch; the others take x as NHWC
    layers: dict[str, dict[str, str]]  # frontend -> {report row: canonical layer}


def _labels(rng: np.random.Generator, n: int, classes: int) -> Array:
    return rng.integers(0, classes, n).astype(np.int64)


def _flax_loss(module: Any, mutable: bool) -> Callable[..., Any]:
    def loss_fn(v: Any, x: Any, y: Any) -> Any:
        if not mutable:
            return optax.softmax_cross_entropy_with_integer_labels(module.apply(v, x), y).mean()
        logits, updates = module.apply(v, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    return loss_fn


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.relu(nn.Dense(16)(x))  # Dense_0, created first
        return nn.Dense(4)(h)


def mlp() -> Triple:
    torch.manual_seed(0)
    t = torch.nn
    net = t.Sequential(t.Linear(12, 16), t.ReLU(), t.Linear(16, 4))
    w = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    params = {f"Dense_{i}": {"kernel": w[f"{j}.weight"].T, "bias": w[f"{j}.bias"]}
              for i, j in ((0, 0), (1, 2))}  # fmt: skip
    inp = keras.Input((12,))
    h = keras.layers.ReLU(name="act")(keras.layers.Dense(16, name="fc1")(inp))
    model = keras.Model(inp, keras.layers.Dense(4, name="fc2")(h))
    for name, j in (("fc1", 0), ("fc2", 2)):
        model.get_layer(name).set_weights([w[f"{j}.weight"].T, w[f"{j}.bias"]])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 12)).astype(np.float32)
    return Triple(
        net, {"params": params}, _flax_loss(FlaxMLP(), mutable=False), model,
        (x, _labels(rng, 4, 4)),
        {
            "torch": {"0": "fc1", "1": "act", "2": "fc2"},
            "jax": {"FlaxMLP.Dense_0": "fc1", "FlaxMLP": "act", "FlaxMLP.Dense_1": "fc2"},
            "keras": {"fc1": "fc1", "act": "act", "fc2": "fc2"},
        },
    )  # fmt: skip


class FlaxCNN(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.99, epsilon=1e-3)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(5)(x.reshape(x.shape[0], -1))


def cnn() -> Triple:
    """conv -> BatchNorm (train mode) -> ReLU -> max pool -> flatten -> dense. The dense
    kernel is permuted from PyTorch's (C, H, W) flattening order to NHWC's (H, W, C)."""
    torch.manual_seed(0)
    t = torch.nn
    net = t.Sequential(t.Conv2d(3, 8, 3, padding=1), t.BatchNorm2d(8, eps=1e-3, momentum=0.01),
                       t.ReLU(), t.MaxPool2d(2), t.Flatten(), t.Linear(128, 5))  # fmt: skip
    net[1].num_batches_tracked = None  # torch counts batches (one add); the others do not
    w = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    conv = w["0.weight"].transpose(2, 3, 1, 0)  # OIHW -> HWIO
    dense = w["5.weight"].reshape(5, 8, 4, 4).transpose(2, 3, 1, 0).reshape(128, 5)
    bn = [w["1.weight"], w["1.bias"], w["1.running_mean"], w["1.running_var"]]
    variables = {
        "params": {"Conv_0": {"kernel": conv, "bias": w["0.bias"]},
                   "BatchNorm_0": {"scale": bn[0], "bias": bn[1]},
                   "Dense_0": {"kernel": dense, "bias": w["5.bias"]}},
        "batch_stats": {"BatchNorm_0": {"mean": bn[2], "var": bn[3]}},
    }  # fmt: skip
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inp)
    h = keras.layers.ReLU(name="relu")(keras.layers.BatchNormalization(name="bn")(h))
    h = keras.layers.Flatten(name="flat")(keras.layers.MaxPooling2D(name="pool")(h))
    model = keras.Model(inp, keras.layers.Dense(5, name="fc")(h))
    model.get_layer("conv").set_weights([conv, w["0.bias"]])
    model.get_layer("bn").set_weights(bn)
    model.get_layer("fc").set_weights([dense, w["5.bias"]])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    return Triple(
        net, variables, _flax_loss(FlaxCNN(), mutable=True), model, (x, _labels(rng, 4, 5)),
        {
            "torch": {"0": "conv", "1": "bn", "2": "relu_pool", "3": "relu_pool",
                      "4": "relu_pool", "5": "fc"},
            "jax": {"FlaxCNN.Conv_0": "conv", "FlaxCNN.BatchNorm_0": "bn",
                    "FlaxCNN": "relu_pool", "FlaxCNN.Dense_0": "fc"},
            "keras": {"conv": "conv", "bn": "bn", "relu": "relu_pool", "pool": "relu_pool",
                      "flat": "relu_pool", "fc": "fc"},
        },
    )  # fmt: skip


def _nhwc(x: Array) -> Array:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x.ndim == 4 else x


def _compile_all(triple: Triple, scheme: Any) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """frontend -> (step, its batch)."""
    x, y = triple.batch_nchw
    t_batch = (torch.from_numpy(x), torch.from_numpy(y))
    batch = (_nhwc(x), y)

    def t_loss(m: Any, a: Any, b: Any) -> Any:
        return torch.nn.functional.cross_entropy(m(a), b)

    return {
        "torch": (pe.compile(triple.torch_model, t_loss, t_batch, scheme=scheme), t_batch),
        "jax": (pe.compile(triple.jax_variables, triple.jax_loss, batch, scheme=scheme), batch),
        "keras": (
            pe.compile(triple.keras_model, loss="cross_entropy", example_batch=batch,
                       scheme=scheme),
            batch,
        ),
    }  # fmt: skip


def _layer_flops(figures: Figures, names: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Canonical layer -> (forward, backward) FLOPs; loss rows left out. A row the name
    table does not know (the batch, a param read outside any module) must cost nothing."""
    out: dict[str, tuple[int, int]] = {}
    for row, f in figures.layers.items():
        if row in LOSS_ROWS:
            continue
        if row not in names:
            assert (f.forward_flops, f.backward_flops) == (0, 0), row
            continue
        fwd, bwd = out.get(names[row], (0, 0))
        out[names[row]] = (fwd + f.forward_flops, bwd + f.backward_flops)
    return out


MODELS = {"mlp": mlp, "cnn": cnn}
SCHEMES = {"full": schemes.full, "bias_only": schemes.bias_only, "head": schemes.head}


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_same_network_in_three_frontends_costs_and_starts_the_same(
    model_name: str, scheme_name: str
) -> None:
    triple = MODELS[model_name]()
    steps = _compile_all(triple, SCHEMES[scheme_name]())
    figures = {fe: step.report().ours for fe, (step, _) in steps.items()}
    layers = {fe: _layer_flops(figures[fe], triple.layers[fe]) for fe in steps}
    ref = layers["torch"]
    assert layers["keras"] == ref
    assert layers["jax"] == ref
    assert sum(bwd for _, bwd in ref.values()) > 0
    if "bn" in ref:  # one batch_norm op (and its gradient, when anything below trains)
        for fe, (step, _) in steps.items():
            ops = [n.op for n in step.graph.nodes]
            forward = [n.op for n in step.graph.nodes if n.phase is not Phase.BACKWARD]
            # (the backward may recompute the batch norm's y: rematerialisation)
            assert forward.count("batch_norm") == 1 and ops.count("assign") == 2, fe
            assert ops.count("batch_norm_grad") == int(ref["bn"][1] > 0), fe
    trained = {fe: f.trained_elements for fe, f in figures.items()}
    assert trained["jax"] == trained["keras"] == trained["torch"] > 0
    if scheme_name != "full":
        assert trained["torch"] < figures["torch"].param_bytes // 4
    losses = {fe: step(*batch) for fe, (step, batch) in steps.items()}
    np.testing.assert_allclose(losses["jax"], losses["torch"], rtol=1e-5)
    np.testing.assert_allclose(losses["keras"], losses["torch"], rtol=1e-5)
