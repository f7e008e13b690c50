"""The Keras frontend against Keras itself (tf.GradientTape, keras.optimizers.AdamW), against
the PyTorch frontend (the same network compiles to the same FLOPs), across backends, and
without TensorFlow installed."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine.sparse import schemes

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

Array = np.ndarray[Any, Any]
RTOL, ATOL = 1e-4, 1e-6


class Block(keras.layers.Layer):
    """A post-norm transformer block: attention, LayerNorm, GELU feed-forward, LayerNorm."""

    def __init__(self, dim: int, heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(heads, dim // heads, name="mha")
        self.ln1 = keras.layers.LayerNormalization(name="ln1")
        self.ff1 = keras.layers.Dense(2 * dim, activation="gelu", name="ff1")
        self.ff2 = keras.layers.Dense(dim, name="ff2")
        self.ln2 = keras.layers.LayerNormalization(name="ln2")

    def call(self, x: Any) -> Any:
        x = self.ln1(x + self.mha(x, x))
        return self.ln2(x + self.ff2(self.ff1(x)))


def transformer() -> Any:
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 16))
    x = Block(16, 2, name="block_0")(inp)
    x = Block(16, 2, name="block_1")(x)
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


def cnn() -> Any:
    """No param whose true gradient is zero (a conv bias before BN, an attention key bias):
    Adam would move it by +-lr on float32 noise, differently in each framework."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1")(inp)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU(name="relu1")(x)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(x)
    x = keras.layers.Conv2D(8, 1, activation="relu6", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    out = keras.layers.Dense(5, name="head")(x)
    return keras.Model(inp, out)


@tf.custom_gradient
def _exact_tanh(x: Any) -> Any:
    """tanh with its own (exact) gradient: TF wraps it in IdentityN."""
    y = tf.tanh(x)
    return y, lambda g: g * (1 - y * y)


class ExactTanh(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        return _exact_tanh(x)


def dilated() -> Any:
    """Dilated Conv1Ds: TF runs them as SpaceToBatchND -> Conv2D -> BatchToSpaceND; a custom
    gradient (IdentityN) and TF's Log1p, Pow and ClipByValue between them."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 3))
    x = keras.layers.Conv1D(4, 3, dilation_rate=2, padding="same", name="c1")(inp)
    x = ExactTanh(name="act")(x)
    # TF's Log1p, Pow by a computed exponent, and ClipByValue (some values clipped)
    x = keras.layers.Lambda(
        lambda t: tf.raw_ops.ClipByValue(
            t=tf.math.log1p(tf.abs(t)) + tf.pow(tf.abs(t) + 0.5, t),
            clip_value_min=0.2,
            clip_value_max=1.6,
        ),
        name="powers",
    )(x)
    x = keras.layers.Conv1D(5, 3, dilation_rate=3, name="c2")(x)
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


def batch(shape: tuple[int, ...], classes: int, seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.integers(0, classes, shape[0]).astype(np.int64)


def keras_loss(model: Any, x: Array, y: Array) -> Any:
    logits = model(x, training=True)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def keras_gradients(model: Any, x: Array, y: Array) -> tuple[float, dict[str, Array]]:
    with tf.GradientTape() as tape:
        loss = keras_loss(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: g.numpy() for v, g in zip(model.trainable_variables, grads,
                                                              strict=True)}  # fmt: skip


MODELS = {
    "cnn": (cnn, (4, 8, 8, 3), 5),
    "transformer": (transformer, (2, 6, 16), 3),
    "dilated": (dilated, (2, 16, 3), 3),
}
SCHEMES = {
    "full": schemes.full(),
    "bias_only": schemes.bias_only(),
    "last_blocks": schemes.last_blocks(1),
    "select": schemes.select(train=["conv2/*", "dw.*", "head.kernel"]),
}
CASES = [("cnn", "full"), ("cnn", "bias_only"), ("cnn", "select"), ("transformer", "full"),
         ("transformer", "bias_only"), ("transformer", "last_blocks"),
         ("dilated", "full")]  # fmt: skip


@pytest.mark.parametrize(("model_name", "scheme_name"), CASES)
def test_loss_and_gradients_match_gradient_tape(model_name: str, scheme_name: str) -> None:
    build, shape, classes = MODELS[model_name]
    scheme = SCHEMES[scheme_name]
    model = build()
    x, y = batch(shape, classes)
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y), scheme=scheme)
    ours = step.gradients(x, y)
    loss = step(x, y)  # trains the step's own copy, not the Keras model
    ref_loss, ref = keras_gradients(model, x, y)
    trained = set(step.trained)
    assert set(ours) == trained and trained <= set(ref)
    if scheme_name != "full":
        assert trained < set(ref)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    for name in trained:
        np.testing.assert_allclose(ours[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_dilated_conv1d_is_traced_through_space_to_batch(caplog: pytest.LogCaptureFixture) -> None:
    x, y = batch((2, 16, 3), 3)
    with caplog.at_level("WARNING", logger="pockengine"):
        step = pe.compile(dilated(), loss="cross_entropy", example_batch=(x, y))
    assert any("act" in r.getMessage() and "custom_gradient" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    ops = [n.op for n in step.forward.nodes]
    # each dilated conv: pad, reshape, transpose, reshape in; reshape, transpose, reshape out
    assert ops.count("conv2d") == 2 and ops.count("transpose") >= 4
    assert {"log1p", "pow", "clamp"} <= set(ops)


def test_schemes_select_keras_layers() -> None:
    info = pe.compile(transformer(), loss="cross_entropy", example_batch=batch((2, 6, 16), 3)).info
    kinds = {p.module: p.module_type for p in info.params}
    assert kinds["block_1.mha.query"] == "EinsumDense"
    assert kinds["block_1.ln2"] == "LayerNormalization" and kinds["head"] == "Dense"
    assert (
        info.head == "head"
        and info.blocks == ""
        and info.containers[""]
        == (
            "block_0",
            "block_1",
        )
    )
    last = schemes.last_blocks(1).resolve(info).names
    assert last == {p.name for p in info.params if p.module.startswith(("block_1.", "head"))}
    slash = schemes.select(train=["block_0/mha/*"]).resolve(info).names
    assert slash == schemes.select(train=["block_0.mha.*"]).resolve(info).names
    assert len(slash) == 8


def test_adamw_and_batchnorm_statistics_match_keras() -> None:
    """pe.optim.AdamW is torch's: eps added to sqrt(v / (1 - b2^t)); Keras adds it to sqrt(v)
    and scales the step by sqrt(1 - b2^t), i.e. uses eps / sqrt(1 - b2^t) in torch's terms.
    With eps = 1e-10 both are 1e-6 or less of every sqrt(v) here, so they agree."""
    model = cnn()
    x, y = batch((4, 8, 8, 3), 5)
    hyper = {"lr": 1e-2, "weight_decay": 0.05, "eps": 1e-10}
    opt = pe.optim.AdamW(lr=hyper["lr"], betas=(0.9, 0.99), eps=hyper["eps"],
                         weight_decay=hyper["weight_decay"])  # fmt: skip
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y), optimizer=opt)
    ref_opt = keras.optimizers.AdamW(
        learning_rate=hyper["lr"], beta_1=0.9, beta_2=0.99, epsilon=hyper["eps"],
        weight_decay=hyper["weight_decay"],
    )  # fmt: skip
    for i in range(5):
        xi, yi = batch((4, 8, 8, 3), 5, seed=i)
        loss = step(xi, yi)
        with tf.GradientTape() as tape:
            ref_loss = keras_loss(model, xi, yi)
        grads = tape.gradient(ref_loss, model.trainable_variables)
        ref_opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        np.testing.assert_allclose(loss, float(ref_loss), rtol=RTOL, err_msg=f"step {i}")
    state = step.state_dict()
    assert {"bn1/moving_mean", "bn1/moving_variance"} <= set(state)
    for v in model.weights:
        np.testing.assert_allclose(state[v.path], v.numpy(), rtol=RTOL, atol=ATOL, err_msg=v.path)


def test_frozen_batchnorm_runs_on_moving_statistics() -> None:
    model = cnn()
    x, y = batch((4, 8, 8, 3), 5)
    scheme = schemes.select(train=["head.*"], frozen_bn="eval")
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y), scheme=scheme)
    before = step.state_dict()["bn1/moving_mean"].copy()
    ours = step.gradients(x, y)
    step(x, y)
    np.testing.assert_array_equal(step.state_dict()["bn1/moving_mean"], before)
    model.get_layer("bn1").trainable = False  # Keras's inference-mode BatchNormalization
    _, ref = keras_gradients(model, x, y)
    for name in ("head/kernel", "head/bias"):
        np.testing.assert_allclose(ours[name], ref[name], rtol=RTOL, atol=ATOL)


def test_unsupported_ops_are_listed_at_once_with_their_layers() -> None:
    inp = keras.Input((4,))
    x = keras.layers.Dense(4, name="dense")(inp)
    x = keras.layers.Lambda(lambda t: tf.math.lgamma(t), name="gamma")(x)
    x = keras.layers.Lambda(lambda t: tf.math.cumsum(t, axis=1), name="running")(x)
    out = keras.layers.Lambda(lambda t: tf.math.atan(t) + t, name="angle")(x)
    model = keras.Model(inp, out)
    x0 = np.ones((2, 4), np.float32)
    with pytest.raises(pe.UnsupportedOpError) as info:
        pe.compile(model, loss="mse", example_batch=(x0, x0))
    entries = set(info.value.entries)
    assert {("Lgamma", "gamma"), ("Cumsum", "running"), ("Atan", "angle")} <= entries
    assert len(entries) == 3


class StoppedScale(keras.layers.Layer):
    """Centres on a stopped batch mean and scales by its weight times the stopped weight;
    ``stop`` is tf.stop_gradient, or the identity for the reference without it."""

    def __init__(self, stop: Any = tf.stop_gradient, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stop = stop

    def build(self, input_shape: Any) -> None:
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_normal",
                                     name="scale")  # fmt: skip

    def call(self, x: Any) -> Any:
        centre = self.stop(tf.reduce_mean(x, axis=0, keepdims=True))
        return (x - centre) * self.scale * self.stop(self.scale)


def stopped_mlp(stop: Any = tf.stop_gradient) -> Any:
    keras.utils.set_random_seed(2)
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, name="fc1")(inp)
    h = keras.layers.ReLU()(StoppedScale(stop, name="stopped")(h))
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


def test_stop_gradient_in_a_layer_matches_gradient_tape() -> None:
    x, y = batch((5, 6), 3)
    model = stopped_mlp()
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y))
    ours = step.gradients(x, y)
    ref_loss, ref = keras_gradients(model, x, y)
    _, passed_through = keras_gradients(stopped_mlp(lambda t: t), x, y)
    assert set(ours) == set(ref) == {"fc1/kernel", "fc1/bias", "stopped/scale", "head/kernel",
                                     "head/bias"}  # fmt: skip
    for name in ours:
        np.testing.assert_allclose(ours[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
    for name in ("fc1/kernel", "stopped/scale"):  # the stops change these gradients
        assert not np.allclose(ref[name], passed_through[name], rtol=RTOL, atol=ATOL)
    assert [n.op for n in step.forward.nodes].count("stop_gradient") == 2
    np.testing.assert_allclose(step(x, y), ref_loss, rtol=RTOL)


def _torch_pair(kind: str) -> tuple[Any, Any, tuple[Array, Array], tuple[Array, Array]]:
    """A PyTorch network and the same Keras network with identical weights."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if kind == "mlp":
        net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        inp = keras.Input((12,))
        h = keras.layers.Dense(16, activation="relu", name="fc1")(inp)
        model = keras.Model(inp, keras.layers.Dense(4, name="fc2")(h))
        model.get_layer("fc1").set_weights(
            [net[0].weight.detach().numpy().T, net[0].bias.detach().numpy()]
        )
        model.get_layer("fc2").set_weights(
            [net[2].weight.detach().numpy().T, net[2].bias.detach().numpy()]
        )
        x, y = batch((4, 12), 4)
        return net, model, (x, y), (x, y)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, eps=1e-3, momentum=0.01),
                        nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))  # fmt: skip
    net[1].num_batches_tracked = None  # torch counts batches (one add); Keras does not
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inp)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn")(h))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(
        keras.layers.MaxPooling2D()(h)
    )
    model = keras.Model(
        inp, keras.layers.Dense(5, name="fc")(keras.layers.GlobalAveragePooling2D()(h))
    )
    t = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    model.get_layer("c1").set_weights([t["0.weight"].transpose(2, 3, 1, 0), t["0.bias"]])
    model.get_layer("bn").set_weights(
        [t["1.weight"], t["1.bias"], t["1.running_mean"], t["1.running_var"]]
    )
    model.get_layer("c2").set_weights([t["4.weight"].transpose(2, 3, 1, 0), t["4.bias"]])
    model.get_layer("fc").set_weights([t["8.weight"].T, t["8.bias"]])
    x, y = batch((4, 3, 8, 8), 5)
    return net, model, (x, y), (np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y)


def _model_flops(figures: Any) -> tuple[int, int]:
    """Forward and backward FLOPs of the network; each frontend lowers its own loss."""
    rows = [f for name, f in figures.layers.items() if name not in ("loss", "<loss_fn>")]
    return sum(f.forward_flops for f in rows), sum(f.backward_flops for f in rows)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_same_network_in_torch_and_keras_costs_the_same(kind: str) -> None:
    import torch

    net, model, torch_batch, keras_batch = _torch_pair(kind)
    tb = tuple(torch.from_numpy(a) for a in torch_batch)
    for scheme in (schemes.full(), schemes.bias_only()):
        ts = pe.compile(net, lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b), tb,
                        scheme=scheme)  # fmt: skip
        ks = pe.compile(model, loss="cross_entropy", example_batch=keras_batch, scheme=scheme)
        ours, theirs = ks.report().ours, ts.report().ours
        assert ours.trained_elements == theirs.trained_elements > 0
        assert _model_flops(ours) == _model_flops(theirs)
        assert _model_flops(ours)[1] > 0
        np.testing.assert_allclose(ks(*keras_batch), ts(*tb), rtol=1e-5)


def test_numpy_and_torch_backends_agree_on_a_keras_model() -> None:
    pytest.importorskip("torch")
    losses = {}
    for backend in ("numpy", "torch"):
        sgd = pe.optim.SGD(lr=0.05, momentum=0.9)
        example = batch((4, 8, 8, 3), 5)
        step = pe.compile(cnn(), loss="cross_entropy", example_batch=example, optimizer=sgd,
                          backend=backend)  # fmt: skip
        losses[backend] = [step(*batch((4, 8, 8, 3), 5)) for _ in range(4)]
    assert losses["numpy"][-1] < losses["numpy"][0]
    np.testing.assert_allclose(losses["torch"], losses["numpy"], rtol=RTOL)


def test_without_tensorflow_the_engine_works_and_the_frontend_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['tensorflow'] = None\n"
        "import numpy as np, pockengine as pe\n"
        "from pockengine.frontend.keras import keras_model_info\n"
        "from pockengine.frontend.loss import LOSSES\n"
        "try:\n"
        "    keras_model_info(object())\n"
        "except pe.CompileError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install "pockengine[tf]"' in out.stdout
