"""Flax and JAX beyond the zoo against jax.grad: transposed convolutions (lhs-dilated),
resizing (its positions folded from constants), flips, products and other reductions,
and ``lax.scan`` (Flax's ``nn.RNN``) unrolled over its steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import pockengine as pe  # noqa: E402
from pockengine.ir import UnsupportedOpError  # noqa: E402
from tests.test_frontend_jax import ATOL, RTOL, _flat, _reference_grads  # noqa: E402

IMAGES, STEPS = (2, 8, 8, 3), (2, 5, 4)


class _Model(nn.Module):
    body: Callable[[Any], Any]

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(3)(self.body(x))


def _pool(x: Any) -> Any:
    return jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))


def _scan_body(carry: Any, x: Any) -> tuple[Any, Any]:
    carry = jnp.tanh(carry * 0.5 + x)
    return carry, carry * x


CASES: dict[str, tuple[Callable[[Any], Any], tuple[int, ...]]] = {
    "activations": (
        lambda x: _pool(
            nn.elu(nn.leaky_relu(nn.Conv(4, (3, 3))(x), 0.2))
            + nn.selu(x[..., :1])
            + nn.celu(x[..., :1])
        ),
        IMAGES,
    ),
    "group-norm": (lambda x: _pool(nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3))(x))), IMAGES),
    "conv-transpose-same": (
        lambda x: _pool(nn.ConvTranspose(4, (3, 3), strides=(2, 2))(x)),
        IMAGES,
    ),
    "conv-transpose-valid-dilated": (
        lambda x: _pool(
            nn.ConvTranspose(4, (3, 2), strides=(2, 3), padding="VALID", kernel_dilation=(2, 1))(x)
        ),
        IMAGES,
    ),
    "conv-transpose-uneven-pads": (
        lambda x: _pool(nn.ConvTranspose(4, (4, 4), strides=(2, 2), padding=((3, 0), (1, 2)))(x)),
        IMAGES,
    ),
    "conv-transpose-wide-pads": (
        lambda x: _pool(nn.ConvTranspose(4, (2, 2), strides=(2, 2), padding=((3, 3), (0, 0)))(x)),
        IMAGES,
    ),
    "conv-transpose-1d": (lambda x: _pool(nn.ConvTranspose(4, (3,), strides=(2,))(x)), STEPS),
    "resize": (
        lambda x: _pool(
            jax.image.resize(nn.Conv(4, (1, 1))(x), (2, 16, 13, 4), "nearest")
            + jax.image.resize(nn.Conv(4, (1, 1))(x), (2, 16, 13, 4), "bilinear")
        ),
        IMAGES,
    ),
    "reductions": (
        lambda x: jnp.concatenate(
            [
                jnp.min(nn.Conv(4, (3, 3))(x), (1, 2)),
                jnp.std(x, (1, 2)),
                jnp.linalg.norm(x, axis=1).mean(1),
                jnp.prod(jnp.tanh(x[:, :2, :2]), (1, 2)),
            ],
            -1,
        ),
        IMAGES,
    ),
    "flip-roll": (lambda x: _pool(jnp.roll(jnp.flip(nn.Conv(4, (3, 3))(x), 1), 2, 2)), IMAGES),
    "lstm": (lambda x: nn.RNN(nn.LSTMCell(5))(x)[:, -1], STEPS),
    "gru-reverse": (lambda x: nn.RNN(nn.GRUCell(5), reverse=True)(x)[:, 0], STEPS),
    "scan-reverse-with-outputs": (
        lambda x: jax.lax.scan(
            _scan_body, jnp.zeros_like(x[:, 0]), jnp.swapaxes(nn.Dense(4)(x), 0, 1), reverse=True
        )[1].mean(0),
        STEPS,
    ),
}


def _setup(name: str) -> tuple[Any, Any, tuple[Any, ...]]:
    body, shape = CASES[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, 3, shape[0]).astype(np.int32)
    model = _Model(body)
    variables = model.init(jax.random.PRNGKey(0), x)

    def loss_fn(v: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

    return variables, loss_fn, (x, y)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_jax_grad(name: str) -> None:
    variables, loss_fn, batch = _setup(name)
    step = pe.compile(variables, loss_fn, batch, optimizer=pe.optim.SGD(lr=0.0))
    loss, ref = _reference_grads(variables, loss_fn, batch)
    ref_flat = _flat(ref)
    got = step.gradients(*batch)
    assert set(got) == set(ref_flat)
    for key, g in got.items():
        np.testing.assert_allclose(g, ref_flat[key], rtol=RTOL, atol=ATOL, err_msg=key)
    np.testing.assert_allclose(step(*batch), float(loss), rtol=RTOL)


def test_a_primitive_on_run_time_values_still_needs_a_converter() -> None:
    """Folding covers constants only: ``floor`` of an activation is listed, with its line."""
    variables, _, batch = _setup("activations")
    model = _Model(lambda x: jnp.floor(_pool(x)))

    def loss_fn(v: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

    variables = model.init(jax.random.PRNGKey(0), batch[0])
    with pytest.raises(UnsupportedOpError, match=r"floor  at .*test_jax_coverage\.py"):
        pe.compile(variables, loss_fn, batch)
