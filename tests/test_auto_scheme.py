"""``--scheme auto``: gradient scores that match torch.autograd, a choice within the
budget that the trained step's own report confirms, the cache, the notes a run prints,
the held-out test split, and a learning rate chosen on training examples only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pockengine.cli import main
from pockengine.finetune import FinetuneConfig, finetune
from pockengine.ir import SchemeError
from pockengine.optim import AdamW
from pockengine.scheme_choice import estimate as est
from pockengine.scheme_choice.auto_scheme import choose_auto, items_from_estimate
from pockengine.scheme_choice.lr_choice import choose_lr
from pockengine.sparse.schemes import scheme_named
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneError
from tests.test_sensitivity import _dataset

FACTORY = "tests.test_auto_scheme:wide_classifier"


class WideClassifier(nn.Module):
    """Embedding, mean pool, three hidden Linear layers of different widths, a head."""

    def __init__(self, vocab_size: int, num_labels: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 16)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(torch.float32)
        h = (self.embed(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        h = torch.tanh(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(h))))))
        out: torch.Tensor = self.head(h)
        return out


def wide_classifier(vocab_size: int, num_labels: int) -> nn.Module:
    return WideClassifier(vocab_size, num_labels)


class NormedClassifier(nn.Module):
    """Embedding, mean pool, Linear, BatchNorm1d (one value a channel per example: batch
    statistics of one example are undefined), Linear, a head."""

    def __init__(self, vocab_size: int, num_labels: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, num_labels)
        with torch.no_grad():  # running statistics unlike any batch's
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(torch.float32)
        h = (self.embed(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        out: torch.Tensor = self.head(torch.tanh(self.fc2(torch.tanh(self.bn(self.fc1(h))))))
        return out


def normed_classifier(vocab_size: int, num_labels: int) -> nn.Module:
    return NormedClassifier(vocab_size, num_labels)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _config(tmp_path: Path, **kw: object) -> FinetuneConfig:
    base = FinetuneConfig(model=FACTORY, data=str(_dataset(tmp_path / "topics.csv")), recipe=None,
                          batch_size=8, seq_len=8, max_train=72, epochs=1, backend="torch",
                          progress="none", scheme="auto", out=str(tmp_path / "run"))  # fmt: skip
    config = dataclasses.replace(base, **kw).validate()  # type: ignore[arg-type]
    return config.with_defaults(recipes.defaults(config)).validate()


def _planner(config: FinetuneConfig, task: recipes.Task) -> est.Planner:
    from pockengine.frontend.torch import import_torch, torch_model_info

    example = tuple(torch.from_numpy(a[:8]) for a in task.train)
    return est.Planner(torch_model_info(task.model),
                       lambda ev, rows: import_torch(task.model, task.loss_fn,
                                                     [a[:rows] for a in example], ev),
                       est.optimizer_of(config))  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [
        est.EstimateSettings(batches=3),  # one example a backward pass, one group
        est.EstimateSettings(batches=3, micro_batch=8),  # whole batches
        est.EstimateSettings(batches=3, micro_batch=3, group_bytes=1),  # 2 rows; one each
    ],
    ids=["default", "whole-batches", "micro-2-one-weight-groups"],
)
def test_scores_are_those_of_torch_autograd(tmp_path: Path, settings: est.EstimateSettings) -> None:
    """Micro-batches and weight groups change how the gradients are taken, not the scores:
    a batch's gradient is the mean of its micro-batches' (this model has no dropout)."""
    config = _config(tmp_path)
    task = recipes.build(config)
    planner = _planner(config, task)
    weights = est.candidate_weights(planner.info, {"head.weight", "head.bias"})
    assert [w.name for w in weights] == ["fc1.weight", "fc2.weight", "fc3.weight"]
    scores = est.estimate_scores(config, task, planner, weights, settings)
    assert [w.param for w in scores.weights] == [w.name for w in weights]
    grads = _autograd_gradients(task, [w.name for w in weights])
    for w in scores.weights:
        g = np.stack(grads[w.param]).astype(np.float64)
        value = task.model.get_parameter(w.param).detach().numpy()
        np.testing.assert_allclose(w.rows["fisher"], (g**2).mean(0).sum(1), rtol=1e-4)
        np.testing.assert_allclose(w.rows["taylor"], np.abs(g.mean(0) * value).sum(1), rtol=1e-4)
        np.testing.assert_allclose(w.rows["grad"], np.abs(g.mean(0)).sum(1), rtol=1e-4)
        # a ratio trains the leading rows, so its score is theirs
        half = w.trained_rows(0.5)
        assert w.score("fisher", 0.5) == pytest.approx(sum(w.rows["fisher"][:half]))
        # its gradient reads the layer's input (float32, batch x in); the matmul is its FLOPs
        # (the graph reads it through a transpose: matmul(x, transpose(w)))
        out_features, in_features = w.shape
        assert w.saved_input_bytes == config.batch_size * in_features * 4
        assert w.forward_flops == 2 * config.batch_size * in_features * out_features
    items = items_from_estimate(scores, "fisher", (0.25, 0.5, 1.0), AdamW())
    assert sum(i.value for i in items if i.ratio == 1.0) == pytest.approx(1.0)
    for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
        mine = sorted((i for i in items if i.group == name), key=lambda i: i.ratio)
        assert [i.value for i in mine] == sorted(i.value for i in mine)
        assert [i.cost["memory"] for i in mine] == sorted(i.cost["memory"] for i in mine)


def test_whole_batches_where_they_fit_the_budget(tmp_path: Path) -> None:
    """The estimate takes whole batches where their gradient step, with its sums, plans
    within the run's budget less the model's weights (which the analysing process holds
    beside the step), and one-example micro-batches otherwise: the same scores either
    way (this model has no dropout), autograd's."""
    config = _config(tmp_path)
    task = recipes.build(config)
    planner = _planner(config, task)
    weights = est.candidate_weights(planner.info, {"head.weight", "head.bias"})
    need = planner.gradient_peak([w.name for w in weights]) + 2 * sum(
        4 * int(np.prod(w.shape)) for w in weights
    )
    need += sum(4 * int(np.prod(p.shape)) for p in planner.info.params)
    settings = est.EstimateSettings(batches=3)
    by_rows = {}
    for budget, rows in ((need, 8), (need - 1, 1), (None, 1)):
        for f in est.cache_folder().glob("*.json"):
            f.unlink()
        scores = est.estimate_scores(config, task, planner, weights, settings, budget)
        assert scores.rows == rows and not scores.cached
        by_rows[rows] = scores
    for whole, one in zip(by_rows[8].weights, by_rows[1].weights, strict=True):
        np.testing.assert_allclose(whole.rows["fisher"], one.rows["fisher"], rtol=1e-4)
    again = est.estimate_scores(config, task, planner, weights, settings, need)
    assert again.cached and again.rows == 1  # the cache says how the scores were taken


def _autograd_gradients(task: recipes.Task, names: list[str]) -> dict[str, list[np.ndarray]]:
    """torch.autograd's gradients of ``names`` on the last 3 batches of 8 of the training
    split, as the estimate reads them."""
    grads: dict[str, list[np.ndarray]] = {}
    for b in range(3):
        batch = [torch.from_numpy(a[len(a) - (b + 1) * 8 : len(a) - b * 8]) for a in task.train]
        task.model.zero_grad()
        task.loss_fn(task.model, *batch).backward()
        for name in names:
            grads.setdefault(name, []).append(task.model.get_parameter(name).grad.numpy())
    return grads


@pytest.mark.parametrize("micro_batch", [1, 8], ids=["one-example", "whole-batches"])
def test_the_estimate_runs_batchnorm_on_its_running_statistics(
    tmp_path: Path, micro_batch: int
) -> None:
    """Batch statistics of a one-example micro-batch normalise each example by itself (a
    BatchNorm1d, or a BatchNorm2d over a 1x1 map, cannot even be traced): the estimate runs
    every BatchNorm on its running statistics, whole batches too, so its scores are
    autograd's on the model with its BatchNorms in eval mode."""
    config = _config(tmp_path, model="tests.test_auto_scheme:normed_classifier")
    task = recipes.build(config)
    planner = _planner(config, task)
    weights = est.candidate_weights(planner.info, {"head.weight", "head.bias"})
    assert [w.name for w in weights] == ["fc1.weight", "fc2.weight"]
    settings = est.EstimateSettings(batches=3, micro_batch=micro_batch)
    scores = est.estimate_scores(config, task, planner, weights, settings)
    assert task.model.training and task.model.bn.training  # the model is left as it was
    task.model.bn.eval()
    grads = _autograd_gradients(task, [w.name for w in weights])
    for w in scores.weights:
        g = np.stack(grads[w.param]).astype(np.float64)
        np.testing.assert_allclose(w.rows["fisher"], (g**2).mean(0).sum(1), rtol=1e-4)
        np.testing.assert_allclose(w.rows["grad"], np.abs(g.mean(0)).sum(1), rtol=1e-4)


def test_auto_trains_within_the_budget_and_says_why(tmp_path: Path) -> None:
    config = _config(tmp_path)
    task = recipes.build(config)
    planner = _planner(config, task)
    bias = planner.figures(scheme_named("bias")).planned_peak_bytes
    full = planner.figures(scheme_named("full")).planned_peak_bytes
    budget = (bias + full) / 2
    result = finetune(dataclasses.replace(config, memory_budget=budget))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    auto = summary["auto_scheme"]
    assert auto["budget_source"] == "--memory-budget" and auto["budget_bytes"] == budget
    chosen = {c["param"] for c in auto["candidates"] if c["ratio"]}
    ratios = [c["ratio"] for c in auto["candidates"]]
    assert chosen and ratios != [1.0, 1.0, 1.0]  # something of the weights stays frozen
    assert all(c["share"] >= 0 and c["extra_mib"] > 0 for c in auto["candidates"])
    # the compiled step of the run: within the budget, training the base and the choice
    assert bias < result.planned_peak_bytes <= budget
    trained = set(result.step.trained)
    assert chosen <= trained and "fc1.bias" in trained and "head.weight" in trained
    assert trained - chosen == {n for n in trained if "bias" in n} | {"head.weight"}
    assert "auto scheme: bias +" in result.summary()
    # the same run again reads its choice from the cache: nothing is estimated
    again = choose_auto(dataclasses.replace(config, memory_budget=budget), recipes.build(config),
                        recipes.RECIPES["generic"].sparse)  # fmt: skip
    assert again.cached and again.scheme.to_dict() == auto["scheme"]


def test_budgets_at_the_edges_are_said(tmp_path: Path) -> None:
    config = _config(tmp_path)
    task = recipes.build(config)
    sparse = recipes.RECIPES["generic"].sparse
    with pytest.raises(FinetuneError, match="below the planned peak of the bias scheme"):
        choose_auto(dataclasses.replace(config, memory_budget=1.0), task, sparse)
    roomy = choose_auto(dataclasses.replace(config, memory_budget=float(1 << 30)), task, sparse)
    assert roomy.scheme.kind == "full"
    assert any("analysis skipped: the budget allows full" in n for n in roomy.notes)


def test_the_score_that_ranks_the_weights_is_the_config_s(tmp_path: Path) -> None:
    """``--auto-score`` picks which of the estimate's scores values the weights; the
    gradients are taken once (every kind is kept), the choice is cached per kind."""
    config = _config(tmp_path)
    task = recipes.build(config)
    planner = _planner(config, task)
    bias = planner.figures(scheme_named("bias")).planned_peak_bytes
    full = planner.figures(scheme_named("full")).planned_peak_bytes
    sparse = recipes.RECIPES["generic"].sparse
    choices = {}
    for kind in est.SCORES:
        run = dataclasses.replace(config, memory_budget=(bias + full) / 2, auto_score=kind)
        choices[kind] = choose_auto(run.validate(), task, sparse)
    first, *rest = est.SCORES
    # the first kind took the gradients; the others read the estimate from the cache
    assert not choices[first].cached and all(choices[k].cached for k in rest)
    for kind, choice in choices.items():
        assert choice.score == kind
        values = [c["score"] for c in choice.candidates]
        shares = [c["share"] for c in choice.candidates]
        # each kind's shares are its own scores over their sum
        assert shares == pytest.approx([v / sum(values) for v in values])
    assert len({tuple(c["score"] for c in ch.candidates) for ch in choices.values()}) == 3
    with pytest.raises(FinetuneError, match="auto_score must be one of fisher, taylor, grad"):
        dataclasses.replace(config, auto_score="l2").validate()


def test_auto_is_a_name_only_the_fine_tuner_resolves() -> None:
    with pytest.raises(SchemeError, match="chosen by pockengine finetune"):
        scheme_named("auto")
    assert main(["inspect", "mlp", "--scheme", "auto"]) == 2


def test_the_test_split_is_seeded_disjoint_and_drawn_from_validation(tmp_path: Path) -> None:
    plain = recipes.build(_config(tmp_path))
    split = recipes.build(_config(tmp_path, test_fraction=0.5))
    assert (
        split.train_size == plain.train_size
        and split.val_size + len(split.test[0]) == plain.val_size
    )
    rows = {tuple(r) for r in plain.val[0]}
    val, test = {tuple(r) for r in split.val[0]}, {tuple(r) for r in split.test[0]}
    assert not val & test and val | test == rows
    assert len(set(split.test[-1].tolist())) == 2  # both classes, though validation is grouped
    again = recipes.build(_config(tmp_path, test_fraction=0.5))
    np.testing.assert_array_equal(again.test[0], split.test[0])
    with pytest.raises(FinetuneError, match="test fraction"):
        recipes.with_test_split(plain, 0.01, 0)


def test_the_lr_is_the_best_on_held_out_training_examples(tmp_path: Path) -> None:
    config = _config(tmp_path)
    choice = choose_lr(config, "bias", (1e-3, 3e-2), steps=4, holdout=24)
    assert [t["lr"] for t in choice.trials] == [1e-3, 3e-2]
    assert choice.lr == min(choice.trials, key=lambda t: t["val_loss"])["lr"]
    by_accuracy = choose_lr(config, "bias", (1e-3, 3e-2), steps=4, holdout=24,
                            criterion="accuracy")  # fmt: skip
    assert by_accuracy.trials == choice.trials  # the same seeded runs, another rule
    best = max(by_accuracy.trials, key=lambda t: (t["val_accuracy"], -t["val_loss"]))
    assert by_accuracy.lr == best["lr"]
    with pytest.raises(FinetuneError, match="criterion"):
        choose_lr(config, "bias", (1e-3,), criterion="f1")
    # the held-out examples are the training split's last ones: fewer train on
    assert choice.settings["train_examples"] == 72 - 24


def test_a_cache_that_cannot_be_written_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CI starts without a cache: a run must not depend on one, nor fail without one."""
    config = _config(tmp_path)
    task = recipes.build(config)
    sparse = recipes.RECIPES["generic"].sparse
    fresh = choose_auto(config, task, sparse)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PE_CACHE", str(blocked))  # its "sensitivity" folder cannot exist
    unwritable = choose_auto(config, task, sparse)
    assert not unwritable.cached and unwritable.scheme == fresh.scheme
    assert "could not write the analysis cache" in caplog.text


def test_batchnorm_running_reaches_every_scheme_auto_plans_and_picks(tmp_path: Path) -> None:
    """``--batchnorm running``: the base, the budget's sparse scheme, every candidate the
    planner measures and the pick run every BatchNorm on its running statistics, so the
    planned peaks are those of the steps that will train; named schemes get it too."""
    from pockengine.tasks.recipe_table import parse_scheme

    config = _config(tmp_path, model="tests.test_auto_scheme:normed_classifier",
                     batchnorm="running")  # fmt: skip
    task = recipes.build(config)
    seen: list[bool] = []
    figures = est.Planner.figures

    def recording(self: est.Planner, scheme: Any) -> Any:
        seen.append(scheme.batchnorm == "running")
        return figures(self, scheme)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(est.Planner, "figures", recording)
        choice = choose_auto(config, task, recipes.RECIPES["generic"].sparse)
    assert seen and all(seen)
    assert choice.scheme.batchnorm == "running"
    assert parse_scheme("bias", None, "running").batchnorm == "running"
    assert parse_scheme("bias", None).batchnorm == "batch"
    with pytest.raises(FinetuneError, match="batchnorm must be one of batch, running"):
        dataclasses.replace(config, batchnorm="eval").validate()


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_is_a_candidate_and_other_embeddings_are_not(tied: bool) -> None:
    """A causal LM's output layer is a candidate whether it is a Linear of its own or the
    token embedding tied to it (``estimate.tied_head``); an embedding table that is only
    an input (the classifier's) is not."""
    from pockengine import zoo
    from pockengine.frontend.torch import torch_model_info

    lm = zoo.llama_lm(layers=1, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64, seq=6,
                      batch=2, tied=tied)  # fmt: skip
    info = torch_model_info(lm.model)
    names = {p.name for p in est.candidate_weights(info, set())}
    assert ("model.embed_tokens.weight" in names) is tied
    assert ("lm_head.weight" in names) is not tied  # an untied head is a Linear
    assert "model.layers.0.mlp.down_proj.weight" in names
    classifier = torch_model_info(wide_classifier(50, 3))
    assert "embed.weight" not in {p.name for p in est.candidate_weights(classifier, set())}
