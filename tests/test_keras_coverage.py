"""Keras layers beyond the zoo against tf.GradientTape: transposed convolutions, resizing
and upsampling, the ELU family, and recurrent layers built with ``unroll=True``; a
recurrent layer left as a While loop is an error that says how to build it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine.ir import UnsupportedOpError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tests.test_frontend_keras import ATOL, RTOL, batch, keras_gradients  # noqa: E402

L = keras.layers
IMAGES, STEPS = (2, 8, 8, 3), (2, 6, 4)


def _gap(x: Any) -> Any:
    return L.GlobalAveragePooling2D()(x)


CASES: dict[str, tuple[Callable[[Any], Any], tuple[int, ...]]] = {
    "elu-selu-leaky": (
        lambda x: (
            _gap(L.ELU()(L.LeakyReLU(0.2)(L.Conv2D(4, 3)(x))))
            + _gap(L.Conv2D(4, 3, activation="selu")(x))
        ),
        IMAGES,
    ),
    "conv-transpose-same": (
        lambda x: _gap(L.Conv2DTranspose(4, 3, strides=2, padding="same")(x)),
        IMAGES,
    ),
    "conv-transpose-uneven-same": (
        lambda x: _gap(L.Conv2DTranspose(4, 4, strides=1, padding="same")(x)),
        IMAGES,
    ),
    "conv-transpose-valid": (lambda x: _gap(L.Conv2DTranspose(4, 3, strides=2)(x)), IMAGES),
    "upsampling": (
        lambda x: (
            _gap(L.Conv2D(4, 1)(L.UpSampling2D(2)(x)))
            * _gap(L.Conv2D(4, 1)(L.UpSampling2D(2, interpolation="bilinear")(x)))
        ),
        IMAGES,
    ),
    "resizing": (
        lambda x: (
            _gap(L.Conv2D(4, 1)(L.Resizing(5, 11)(x)))
            + _gap(L.Conv2D(4, 1)(L.Resizing(13, 7, interpolation="nearest")(x)))
        ),
        IMAGES,
    ),
    "every-activation": (
        lambda x: _gap(
            L.Concatenate()(
                [
                    L.Conv2D(2, 1, activation=a)(x)
                    for a in (
                        "softplus",
                        "softsign",
                        "swish",
                        "hard_sigmoid",
                        "mish",
                        "gelu",
                        "exponential",
                        "hard_silu",
                        "relu6",
                        "leaky_relu",
                        "elu",
                        "selu",
                        "log_softmax",
                        "softmax",
                    )
                ]
            )
        ),
        IMAGES,
    ),
    "gru-unrolled": (lambda x: L.GRU(5, unroll=True)(x), STEPS),
    "bidirectional-lstm-unrolled": (lambda x: L.Bidirectional(L.LSTM(5, unroll=True))(x), STEPS),
}


def _model(body: Callable[[Any], Any], shape: tuple[int, ...]) -> Any:
    keras.utils.set_random_seed(0)
    inp = keras.Input(shape[1:])
    return keras.Model(inp, L.Dense(3, name="head")(body(inp)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_gradients_match_gradient_tape(name: str) -> None:
    body, shape = CASES[name]
    model = _model(body, shape)
    x, y = batch(shape, 3)
    step = pe.compile(model, loss="cross_entropy", example_batch=(x, y))
    ours = step.gradients(x, y)
    ref_loss, ref = keras_gradients(model, x, y)
    assert set(ours) == set(ref)
    np.testing.assert_allclose(step(x, y), ref_loss, rtol=RTOL)
    for key, g in ours.items():
        np.testing.assert_allclose(g, ref[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_a_recurrent_while_loop_says_to_unroll() -> None:
    model = _model(lambda x: L.GRU(5)(x), STEPS)
    x, y = batch(STEPS, 3)
    with pytest.raises(UnsupportedOpError, match="While  at gru") as caught:
        pe.compile(model, loss="cross_entropy", example_batch=(x, y))
    assert "build it with unroll=True" in str(caught.value)
