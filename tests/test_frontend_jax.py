"""The JAX frontend: Flax models match jax.grad and optax, schemes select pytree paths,
state_dict() keeps the pytree, unsupported primitives are listed at once, and the same
model in PyTorch and JAX costs the same FLOPs."""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import pockengine as pe  # noqa: E402
from pockengine.ir import CompileError, SchemeError, UnsupportedOpError  # noqa: E402
from pockengine.optim import SGD, AdamW  # noqa: E402
from pockengine.plan.report import analyze  # noqa: E402
from pockengine.sparse import schemes  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6


def _flat(tree: Any) -> dict[str, np.ndarray]:
    """{"a/b/c": array} of a pytree, as the frontend names leaves."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(leaf)
    return out


# -- models ---------------------------------------------------------------------------


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(5)(x.reshape(x.shape[0], -1))


class Attention(nn.Module):
    """Hand-written self attention (two heads), as a Flax block would be."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        b, t, d = x.shape
        qkv = nn.Dense(3 * d)(x).reshape(b, t, 3, 2, d // 2)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 2)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(d)(out.reshape(b, t, d))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = x + Attention()(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)), approximate=False)
        return x + nn.Dense(x.shape[-1])(h)


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, ids: Any) -> Any:
        x = nn.Embed(11, 16)(ids)
        x = nn.MultiHeadDotProductAttention(num_heads=2)(x, x) + x
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(11)(nn.LayerNorm()(x))


@functools.cache
def _cnn() -> tuple[Any, Any, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 12, 12, 3)).astype(np.float32)
    y = rng.integers(0, 5, 4).astype(np.int32)
    model = CNN()
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)

    def loss_fn(v: Any, x: Any, y: Any) -> Any:
        logits, updates = model.apply(v, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    return variables, loss_fn, (x, y)


@functools.cache
def _transformer() -> tuple[Any, Any, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 11, (2, 6)).astype(np.int32)
    model = Transformer()
    variables = jax.jit(model.init)(jax.random.PRNGKey(1), ids)

    def loss_fn(v: Any, ids: Any) -> Any:
        logits = model.apply(v, ids)[:, :-1]
        labels = jax.nn.one_hot(ids[:, 1:], 11)
        return optax.softmax_cross_entropy(logits, labels).mean()

    return variables, loss_fn, (ids,)


def _reference_grads(variables: Any, loss_fn: Any, batch: tuple[Any, ...]) -> Any:
    def loss_only(v: Any) -> Any:
        out = loss_fn(v, *batch)
        return out[0] if isinstance(out, tuple) else out

    return jax.jit(jax.value_and_grad(loss_only))(variables)


SPARSE = {
    "cnn": schemes.select(train=["*bias", "*BatchNorm_0*", "params/Dense_0/*"]),
    "transformer": schemes.sparse(blocks=1),
}
MODELS = {"cnn": _cnn, "transformer": _transformer}


# -- gradients and optimizer steps -------------------------------------------------


@pytest.mark.parametrize("model", ["cnn", "transformer"])
@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_loss_and_gradients_match_jax_grad(model: str, scheme: str) -> None:
    variables, loss_fn, batch = MODELS[model]()
    chosen = schemes.full() if scheme == "full" else SPARSE[model]
    step = pe.compile(variables, loss_fn, batch, scheme=chosen)
    loss, ref = _reference_grads(variables, loss_fn, batch)
    ref_flat = {k: v for k, v in _flat(ref).items() if k.startswith("params/")}
    grads = step.gradients(*batch)
    if scheme == "full":
        assert set(grads) == set(ref_flat)
    else:
        assert 0 < len(grads) < len(ref_flat)
        frozen = set(ref_flat) - set(grads)
        assert frozen and all(not name.endswith("bias") for name in frozen)
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_flat[name], rtol=RTOL, atol=ATOL, err_msg=name)
    assert step(*batch) == pytest.approx(float(loss), rel=RTOL)


def test_sparse_scheme_selects_last_block_and_head() -> None:
    variables, loss_fn, batch = _transformer()
    step = pe.compile(variables, loss_fn, batch, scheme=schemes.sparse(blocks=1))
    assert step.info.blocks == "params.Block_*"
    assert step.info.head == "params.Dense_0"
    trained = set(step.trained)
    assert "params/Block_1/Dense_0/kernel" in trained
    assert "params/Dense_0/kernel" in trained  # the head
    assert "params/Block_0/Dense_0/kernel" not in trained
    assert "params/Block_0/Dense_0/bias" in trained
    assert "params/Embed_0/embedding" not in trained


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_adamw_matches_optax(model: str) -> None:
    variables, loss_fn, batch = MODELS[model]()
    # eps 1e-4: a param whose true gradient is zero (a key bias, a conv bias before
    # BatchNorm) otherwise moves on float32 rounding noise, differently in each engine
    hyper = {"b1": 0.9, "b2": 0.99, "eps": 1e-4, "weight_decay": 0.05}
    opt = AdamW(lr=1e-2, betas=(hyper["b1"], hyper["b2"]), eps=hyper["eps"],
                weight_decay=hyper["weight_decay"])  # fmt: skip
    step = pe.compile(variables, loss_fn, batch, optimizer=opt, scheme=schemes.full())
    tx = optax.adamw(1e-2, **hyper)
    params, state = variables["params"], None
    others = {k: v for k, v in variables.items() if k != "params"}
    state = tx.init(params)

    def loss_of(p: Any, others: Any) -> Any:
        out = loss_fn({"params": p, **others}, *batch)
        return out if isinstance(out, tuple) else (out, {})

    @jax.jit
    def optax_step(params: Any, state: Any, others: Any) -> Any:
        (_, updates), grads = jax.value_and_grad(loss_of, has_aux=True)(params, others)
        changes, state = tx.update(grads, state, params)
        return optax.apply_updates(params, changes), state, {**others, **updates}

    for _ in range(5):
        step(*batch)
        params, state, others = optax_step(params, state, others)
    ours = _flat(step.state_dict())
    for name, want in _flat({"params": params, **others}).items():
        np.testing.assert_allclose(ours[name], want, rtol=RTOL, atol=1e-5, err_msg=name)


def test_batchnorm_running_stats_update_as_flax() -> None:
    variables, loss_fn, batch = _cnn()
    step = pe.compile(variables, loss_fn, batch, optimizer=SGD(lr=0.0))
    expected = variables
    for _ in range(2):
        step(*batch)
        _, updates = jax.jit(loss_fn)(expected, *batch)
        expected = {**expected, **updates}
    ours, want = _flat(step.state_dict()), _flat(expected)
    stats = [k for k in want if k.startswith("batch_stats/")]
    assert {k.rsplit("/", 1)[-1] for k in stats} == {"mean", "var"}
    for name in stats:
        assert not np.allclose(want[name], _flat(variables)[name])  # they did move
        np.testing.assert_allclose(ours[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


class Norms(nn.Module):
    """BatchNorms lowered whole (0: defaults, 1: no scale and the exact variance) and left
    to Flax (2: two feature axes; 3: running averages)."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(6)(x))
        h = nn.BatchNorm(use_running_average=False, use_scale=False,
                         use_fast_variance=False, epsilon=1e-3)(jnp.tanh(h))  # fmt: skip
        h = nn.BatchNorm(use_running_average=False, axis=(-2, -1))(h.reshape(-1, 2, 3))
        h = nn.BatchNorm(use_running_average=True)(jnp.tanh(h).reshape(-1, 6))
        return nn.Dense(3)(h)


@functools.cache
def _norms() -> tuple[Any, Any, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 3, 5).astype(np.int32)
    model = Norms()
    variables = jax.jit(model.init)(jax.random.PRNGKey(2), x)
    stats = jax.tree_util.tree_map(lambda a: a + rng.uniform(0.5, 1.0, a.shape).astype(a.dtype),
                                   variables["batch_stats"])  # fmt: skip
    variables = {**variables, "batch_stats": stats}  # running averages that are not 0 and 1

    def loss_fn(v: Any, x: Any, y: Any) -> Any:  # apply under jit: the call is inlined
        logits, updates = jax.jit(functools.partial(model.apply, mutable=["batch_stats"]))(v, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    return variables, loss_fn, (x, y)


def test_flax_batchnorm_in_training_mode_is_one_batch_norm_op() -> None:
    variables, loss_fn, batch = _norms()
    step = pe.compile(variables, loss_fn, batch, optimizer=SGD(lr=0.0))
    by_module: dict[str, list[str]] = {}
    for node in step.forward.nodes:
        by_module.setdefault(node.source.rsplit(".", 1)[-1], []).append(node.op)
    for name in ("BatchNorm_0", "BatchNorm_1"):  # whole: no rsqrt, no E[x^2]
        assert by_module[name].count("batch_norm") == 1, name
        assert not {"rsqrt", "square", "mean", "sum"} & set(by_module[name]), name
    for name in ("BatchNorm_2", "BatchNorm_3"):  # left to Flax: primitive by primitive
        assert "batch_norm" not in by_module[name] and "rsqrt" in by_module[name], name
    ops = [n.op for n in step.graph.nodes]
    assert ops.count("batch_norm_grad") == 2
    assert ops.count("assign") == 6  # BatchNorm_3 returns its statistics unchanged
    loss, ref = _reference_grads(variables, loss_fn, batch)
    grads = step.gradients(*batch)
    assert set(grads) == {k for k in _flat(ref) if k.startswith("params/")}
    for name, want in _flat(ref).items():
        if name in grads:
            np.testing.assert_allclose(grads[name], want, rtol=RTOL, atol=1e-5, err_msg=name)
    assert step(*batch) == pytest.approx(float(loss), rel=RTOL)
    step(*batch)
    expected = variables
    for _ in range(2):  # SGD with lr 0: only the running statistics move
        _, updates = jax.jit(loss_fn)(expected, *batch)
        expected = {**expected, **updates}
    ours, want = _flat(step.state_dict()), _flat(expected)
    for name in want:
        np.testing.assert_allclose(ours[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    moved = [k for k in want if not np.allclose(want[k], _flat(variables)[k])]
    assert {k.rsplit("/", 2)[-2] for k in moved} == {"BatchNorm_0", "BatchNorm_1", "BatchNorm_2"}


def test_loss_fn_that_differentiates_the_model_is_traced_primitive_by_primitive() -> None:
    """A gradient penalty takes jax.grad of the model inside loss_fn; the whole-BatchNorm
    primitive has no JVP rule, so the frontend traces again without it."""
    variables, _, (x, y) = _norms()
    model = Norms()

    def loss_fn(v: Any, x: Any, y: Any) -> Any:
        def total(x: Any) -> Any:
            logits, updates = model.apply(v, x, mutable=["batch_stats"])
            return logits.sum(), updates

        gx, _ = jax.grad(total, has_aux=True)(x)
        logits, updates = model.apply(v, x, mutable=["batch_stats"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.1 * jnp.sum(gx**2), updates

    step = pe.compile(variables, loss_fn, (x, y))
    assert "batch_norm" not in {n.op for n in step.graph.nodes}
    loss, ref = _reference_grads(variables, loss_fn, (x, y))
    grads = step.gradients(x, y)
    for name, want in _flat(ref).items():
        if name in grads:
            np.testing.assert_allclose(grads[name], want, rtol=RTOL, atol=1e-5, err_msg=name)
    assert len(grads) == len([k for k in _flat(ref) if k.startswith("params/")])
    assert step(x, y) == pytest.approx(float(loss), rel=RTOL)


# -- plain pytrees, state_dict, errors --------------------------------------------


def _mlp_params(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "hidden": {"w": rng.standard_normal((6, 8)).astype(np.float32) * 0.3,
                   "b": np.zeros(8, np.float32)},
        "out": {"w": rng.standard_normal((8, 3)).astype(np.float32) * 0.3,
                "b": np.zeros(3, np.float32)},
    }  # fmt: skip


def _mlp_loss(p: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"])
    return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - y) ** 2)


def test_plain_dict_mlp_trains_and_keeps_its_structure() -> None:
    rng = np.random.default_rng(2)
    params = _mlp_params(rng)
    x, y = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 3))
    y = y.astype(np.float32)
    step = pe.compile(params, _mlp_loss, (x, y), optimizer=SGD(lr=0.1))
    assert set(step.trained) == {"hidden/w", "hidden/b", "out/w", "out/b"}
    losses = [step(x, y) for _ in range(4)]
    assert losses[-1] < losses[0]
    state = step.state_dict()
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(params)
    assert set(step.flat_state_dict()) == set(_flat(params))
    p = params
    for _ in range(4):  # plain SGD by jax.grad gives the same params
        g = jax.grad(_mlp_loss)(p, x, y)
        p = jax.tree_util.tree_map(lambda w, gw: w - 0.1 * gw, p, g)
    for name, want in _flat(p).items():
        np.testing.assert_allclose(_flat(state)[name], want, rtol=RTOL, atol=ATOL)


def test_scheme_patterns_use_pytree_paths_and_channel_ratios_are_refused() -> None:
    rng = np.random.default_rng(3)
    params = _mlp_params(rng)
    batch = (np.ones((2, 6), np.float32), np.ones((2, 3), np.float32))
    step = pe.compile(params, _mlp_loss, batch, scheme=schemes.select(train=["out/*"]))
    assert set(step.trained) == {"out/w", "out/b"}
    with pytest.raises(SchemeError, match=r"hidden\.w .*output channels on axis 1"):
        pe.compile(params, _mlp_loss, batch, scheme=schemes.full(channels={"*": 0.5}))


def test_unsupported_primitives_are_listed_at_once_with_source_lines() -> None:
    params = {"w": np.ones((4,), np.float32)}

    def loss_fn(p: Any, x: Any) -> Any:
        a = jnp.sort(x * p["w"])  # line A
        b = jnp.arctan2(a, x)  # line B
        return jnp.sum(jnp.cumprod(b))  # line C

    x = np.linspace(1, 2, 4, dtype=np.float32)
    with pytest.raises(UnsupportedOpError) as info:
        pe.compile(params, loss_fn, (x,))
    ops = [op for op, _ in info.value.entries]
    assert {"sort", "atan2", "cumprod"} <= set(ops)
    where = " ".join(w for _, w in info.value.entries)
    assert "test_frontend_jax.py" in where and "loss_fn" in where
    lines = {w.split(":")[1] for op, w in info.value.entries if op in ("sort", "atan2")}
    assert len(lines) == 2  # each primitive at its own line


def test_stop_gradient_blocks_the_gradient_as_jax_grad() -> None:
    """stop_gradient of a param, of a param-dependent hidden value, and on the only path to
    a param: gradients equal jax.grad's, and nothing of the stopped backward is left (the
    backward costs what it costs with the stopped values fed in as data)."""
    rng = np.random.default_rng(3)
    params = {name: rng.standard_normal(shape).astype(np.float32)
              for name, shape in (("w", (5, 3)), ("b", (3,)), ("c", (3,)))}  # fmt: skip

    def loss_with(stop: Any, p: Any, x: Any) -> Any:
        h = jnp.tanh(x @ p["w"] + p["b"])
        target = stop(2.0 * h + p["c"])  # c reaches the loss only through here
        return jnp.sum((h - target) ** 2) + jnp.sum(stop(p["w"]) * p["w"])

    loss_fn = functools.partial(loss_with, jax.lax.stop_gradient)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    step = pe.compile(params, loss_fn, (x,))
    ref = jax.grad(loss_fn)(params, x)
    passed_through = jax.grad(functools.partial(loss_with, lambda t: t))(params, x)
    grads = step.gradients(x)
    assert set(grads) == {"w", "b"} and not np.any(ref["c"])  # no cotangent reaches c
    for name in ("w", "b"):
        np.testing.assert_allclose(grads[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
        assert not np.allclose(ref[name], passed_through[name], rtol=RTOL, atol=ATOL)
    assert step(x) == pytest.approx(float(loss_fn(params, x)), rel=RTOL)

    def fed_loss(p: Any, x: Any, target: Any, w: Any) -> Any:
        h = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.sum((h - target) ** 2) + jnp.sum(w * p["w"])

    h = np.tanh(x @ params["w"] + params["b"])
    fed = pe.compile(params, fed_loss, (x, 2.0 * h + params["c"], params["w"]))
    # the backward autodiff derived (before rematerialisation, which may recompute the
    # stopped forward values from what is saved, and not data fed in)
    ours, plain = (analyze(dict(s.stages)["fuse_linear_bias"]) for s in (step, fed))
    assert ours.backward_flops == plain.backward_flops > 0


def test_without_jax_the_engine_imports_and_the_frontend_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax now raises ImportError
    with pytest.raises(CompileError, match=r'pip install "pockengine\[jax\]"'):
        pe.compile({"w": np.ones(3, np.float32)}, lambda p, x: (p["w"] * x).sum(),
                   (np.ones(3, np.float32),))  # fmt: skip


# -- the same model in PyTorch and JAX ----------------------------------------------


def _torch_and_jax_mlp() -> tuple[Any, ...]:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    params = {"params": {f"Dense_{i}": {"kernel": tm[j].weight.detach().numpy().T.copy(),
                                        "bias": tm[j].bias.detach().numpy().copy()}
                         for i, j in ((0, 0), (1, 2))}}  # fmt: skip

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            h = nn.relu(nn.Dense(16)(x))  # Dense_0, created first
            return nn.Dense(3)(h)

    x = rng.standard_normal((4, 6)).astype(np.float32)
    y = rng.standard_normal((4, 3)).astype(np.float32)
    return (
        tm,
        (lambda m, x, y: ((m(x) - y) ** 2).sum()),
        params,
        (lambda p, x, y: ((MLP().apply(p, x) - y) ** 2).sum()),
        (torch.from_numpy(x), torch.from_numpy(y)),
        (x, y),
    )


def _torch_and_jax_cnn() -> tuple[Any, ...]:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)

    class TorchCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x: Any) -> Any:
            x = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
            return self.fc(torch.relu(self.c2(x)).sum((2, 3)))

    class JaxCNN(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.max_pool(nn.relu(nn.Conv(8, (3, 3), use_bias=False)(x)), (2, 2), (2, 2))
            return nn.Dense(4)(nn.relu(nn.Conv(8, (3, 3), use_bias=False)(x)).sum((1, 2)))

    tm = TorchCNN()
    params = {"params": {
        "Conv_0": {"kernel": tm.c1.weight.detach().numpy().transpose(2, 3, 1, 0).copy()},
        "Conv_1": {"kernel": tm.c2.weight.detach().numpy().transpose(2, 3, 1, 0).copy()},
        "Dense_0": {"kernel": tm.fc.weight.detach().numpy().T.copy(),
                    "bias": tm.fc.bias.detach().numpy().copy()},
    }}  # fmt: skip
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    y = rng.standard_normal((2, 4)).astype(np.float32)
    return (
        tm,
        (lambda m, x, y: ((m(x) - y) ** 2).sum()),
        params,
        (lambda p, x, y: ((JaxCNN().apply(p, x) - y) ** 2).sum()),
        (torch.from_numpy(x), torch.from_numpy(y)),
        (x.transpose(0, 2, 3, 1).copy(), y),
    )


@pytest.mark.parametrize("make", [_torch_and_jax_mlp, _torch_and_jax_cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("scheme", ["full", "head"])
def test_same_model_in_torch_and_jax_costs_the_same(make: Any, scheme: str) -> None:
    tm, t_loss, params, j_loss, t_batch, j_batch = make()
    chosen = schemes.full() if scheme == "full" else schemes.head()
    t_step = pe.compile(tm, t_loss, t_batch, scheme=chosen)
    j_step = pe.compile(params, j_loss, j_batch, scheme=chosen)
    t_report, j_report = t_step.report(), j_step.report()
    for figures in ("ours", "full"):
        t_fig, j_fig = getattr(t_report, figures), getattr(j_report, figures)
        assert j_fig.forward_flops == t_fig.forward_flops > 0
        assert j_fig.backward_flops == t_fig.backward_flops > 0
        assert j_fig.trained_elements == t_fig.trained_elements > 0
    assert j_step(*j_batch) == pytest.approx(t_step(*t_batch), rel=RTOL)


# -- backends -------------------------------------------------------------------------


def test_numpy_and_torch_backends_give_the_same_losses() -> None:
    pytest.importorskip("torch")
    variables, loss_fn, batch = _cnn()
    opt = AdamW(lr=1e-2, eps=1e-5)
    runs = []
    for backend in ("numpy", "torch"):
        step = pe.compile(variables, loss_fn, batch, optimizer=opt, backend=backend)
        runs.append([step(*batch) for _ in range(3)])
    np.testing.assert_allclose(runs[0], runs[1], rtol=RTOL)
    assert runs[0][-1] < runs[0][0]


def test_log1p_and_a_computed_exponent_match_jax_grad() -> None:
    """optax's sigmoid BCE (log1p) and ``base ** exponent`` with a trained exponent."""
    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((5, 3)).astype(np.float32),
              "e": rng.uniform(-1, 1, (3,)).astype(np.float32)}  # fmt: skip

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        z = x @ p["w"]
        powered = (jnp.abs(z) + 0.5) ** p["e"]
        return jnp.mean(jnp.log1p(jnp.exp(-jnp.abs(z))) + powered - y * z)

    x = (8 * rng.standard_normal((4, 5))).astype(np.float32)  # large |z|: tiny log1p inputs
    y = (rng.random((4, 3)) > 0.5).astype(np.float32)
    step = pe.compile(params, loss_fn, (x, y))
    assert {"log1p", "pow"} <= {n.op for n in step.forward.nodes}
    ref = jax.grad(loss_fn)(params, x, y)
    for name, g in step.gradients(x, y).items():
        np.testing.assert_allclose(g, ref[name], rtol=RTOL, atol=ATOL, err_msg=name)
    assert step(x, y) == pytest.approx(float(loss_fn(params, x, y)), rel=RTOL)
