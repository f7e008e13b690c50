"""The server's adaptive optimizers (Reddi et al. 2021: FedAdam, FedYogi, FedAdagrad) over
named, partial arrays (issue 18): the update against a hand-written NumPy reference, the
options, the moments saved with the global state and resumed, and a partial-channel
param whose frozen rows never move."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pockengine.federated import FederatedConfig, FederatedError
from pockengine.federated.server_step import ServerStep
from pockengine.finetune import FinetuneConfig
from tests.test_federated import finetune  # noqa: F401  (a fixture)

Array = np.ndarray[Any, Any]
STATS = frozenset({"bn.running_mean"})
BETAS, TAU, LR = (0.8, 0.95), 1e-2, 0.05


def _reference(optimizer: str, x0: Array, averages: list[Array]) -> list[Array]:
    """Reddi et al.'s Algorithm 2 (no bias correction), element by element in Python
    floats: the global array after each round."""
    b1, b2 = BETAS
    x, m, v = x0.astype(np.float64).ravel().tolist(), [0.0] * x0.size, [TAU**2] * x0.size
    out = []
    for average in averages:
        for i, a in enumerate(average.astype(np.float64).ravel().tolist()):
            d = a - x[i]
            m[i] = b1 * m[i] + (1 - b1) * d
            if optimizer == "adagrad":
                v[i] = v[i] + d * d
            elif optimizer == "adam":
                v[i] = b2 * v[i] + (1 - b2) * d * d
            else:
                v[i] = v[i] - (1 - b2) * d * d * float(np.sign(v[i] - d * d))
            x[i] = x[i] + LR * m[i] / (v[i] ** 0.5 + TAU)
        out.append(np.array(x).reshape(x0.shape))
    return out


def _rounds(rng: np.random.Generator, x0: Array, n: int) -> list[Array]:
    """Clients' averages near the starting point, steps of mixed size and sign."""
    return [x0 + np.asarray(rng.normal(0, 0.05 * (r + 1), x0.shape), np.float32) for r in range(n)]


@pytest.mark.parametrize("optimizer", ["adam", "yogi", "adagrad"])
def test_adaptive_steps_match_the_reference(optimizer: str) -> None:
    rng = np.random.default_rng(1)
    x = {"w": rng.normal(size=(3, 4)).astype(np.float32), "bn.running_mean": np.zeros(4, "f4")}
    step = ServerStep(STATS, LR, optimizer=optimizer, betas=BETAS, tau=TAU)
    averages = _rounds(rng, x["w"], 4)
    expected = _reference(optimizer, x["w"], averages)
    for r, (average, want) in enumerate(zip(averages, expected, strict=True)):
        stats = np.full(4, float(r), np.float32)
        x = step.apply(x, {"w": average, "bn.running_mean": stats})
        assert x["w"].dtype == np.float32
        np.testing.assert_allclose(x["w"], want, rtol=1e-5, atol=1e-6, err_msg=f"round {r}")
        np.testing.assert_array_equal(x["bn.running_mean"], stats)  # statistics: the average
    assert set(step.velocity) == set(step.second_moment) == {"w"}


def test_the_optimizers_differ_and_avg_with_momentum_is_avgm() -> None:
    """The three adaptive rules are not one rule (the same averages give three different
    states), and ``avg`` with momentum is FedAvgM as before."""
    rng = np.random.default_rng(2)
    x0 = {"w": rng.normal(size=(5,)).astype(np.float32)}
    averages = _rounds(rng, x0["w"], 3)
    finals = {}
    for optimizer in ("adam", "yogi", "adagrad", "avg", "avgm"):
        step = ServerStep(frozenset(), 0.5 if optimizer.startswith("avg") else LR, 0.9 if
                          optimizer.startswith("avg") else 0.0, optimizer=optimizer)  # fmt: skip
        x = x0
        for average in averages:
            x = step.apply(x, {"w": average})
        finals[optimizer] = x["w"]
    np.testing.assert_array_equal(finals["avg"], finals["avgm"])
    for a, b in (("adam", "yogi"), ("adam", "adagrad"), ("yogi", "adagrad")):
        assert not np.allclose(finals[a], finals[b]), (a, b)


def test_server_optimizer_options_are_checked() -> None:
    with pytest.raises(FederatedError, match="server_optimizer must be one of"):
        FederatedConfig(server_optimizer="sgd").validate()
    with pytest.raises(FederatedError, match="takes its momentum from server_betas"):
        FederatedConfig(server_optimizer="adam", server_momentum=0.9).validate()
    with pytest.raises(FederatedError, match="server_betas must be two numbers in"):
        FederatedConfig(server_optimizer="yogi", server_betas=(0.9, 1.0)).validate()
    with pytest.raises(FederatedError, match="server_tau must be > 0"):
        FederatedConfig(server_optimizer="adagrad", server_tau=0.0).validate()
    config = FederatedConfig(server_optimizer="adam", server_betas=(0.5, 0.9)).validate()
    step = FederatedConfig.from_json(config.to_json()).server_step(frozenset())
    assert (step.optimizer, step.lr, step.betas, step.tau) == ("adam", 0.01, (0.5, 0.9), 1e-3)
    assert FederatedConfig(server_momentum=0.9).server_step(frozenset()).lr == 1.0


@pytest.mark.skipif(find_spec("flwr") is None, reason="Flower is not installed")
def test_a_restarted_server_resumes_its_moments_and_partial_rows_stay_frozen(
    finetune: FinetuneConfig,  # noqa: F811
) -> None:
    """FedAdam over the tiny task whose fc.weight trains its first 8 of 16 rows: its
    moments have the sent (partial) shape, merging the step's result moves only those
    rows, and a server restarted from global.safetensors takes the same next step as
    the one that kept running."""
    from pockengine.federated.local import prepare
    from pockengine.federated.payload import TrainedSet
    from pockengine.federated.server import _RoundLog, _start_state

    config = FederatedConfig(finetune=finetune, clients=2, rounds=3, server_optimizer="adam")
    config, task, step = prepare(config)
    trained = TrainedSet.of(step)
    before = step.flat_state_dict(["fc.weight"])["fc.weight"].copy()
    rng = np.random.default_rng(3)
    x0 = trained.extract(step)
    server = config.server_step(trained.buffers)
    x1 = server.apply(x0, {k: v + np.asarray(rng.normal(0, 0.01, v.shape), v.dtype)
                           for k, v in x0.items()})  # fmt: skip
    assert server.velocity["fc.weight"].shape == server.second_moment["fc.weight"].shape == (8, 16)
    trained.merge(step, x1, "test")
    after = step.flat_state_dict(["fc.weight"])["fc.weight"]
    np.testing.assert_array_equal(after[8:], before[8:])  # the frozen rows did not move
    np.testing.assert_array_equal(after[:8], x1["fc.weight"])
    assert not np.array_equal(after[:8], before[:8])

    out = Path(str(finetune.out))
    out.mkdir()
    _RoundLog(config, task, step, trained, out, 0.0)._save(1, x1, server.state())
    restarted = config.server_step(trained.buffers)
    done, loaded = _start_state(dataclasses.replace(config, resume=True), out, trained, step,
                                restarted)  # fmt: skip
    assert done == 1 and set(loaded) == set(x1)
    average = {k: v + np.asarray(rng.normal(0, 0.01, v.shape), v.dtype) for k, v in x1.items()}
    kept, resumed = server.apply(x1, average), restarted.apply(loaded, average)
    for name in x1:
        np.testing.assert_array_equal(resumed[name], kept[name], err_msg=name)


def test_a_run_saved_before_the_server_optimizers_existed_resumes() -> None:
    """The options a session-8 run saved (no server_optimizer, betas or tau; server_lr
    1.0) train as today's defaults do; a different option still refuses."""
    import json

    config = FederatedConfig(server_momentum=0.9).validate()
    saved = json.loads(json.dumps(config.training_dict()))
    for new in ("server_optimizer", "server_betas", "server_tau"):
        del saved[new]
    assert saved["server_lr"] == 1.0
    assert config.trains_as_saved(saved)
    assert not config.trains_as_saved({**saved, "server_momentum": 0.5})
    adam = FederatedConfig(server_optimizer="adam").validate()
    assert not adam.trains_as_saved(saved)
