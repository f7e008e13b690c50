"""``auto`` is the default scheme of every recipe and of ``--model/--data``
(docs/quality.md, "Verdict"); commands that compile
without the fine-tuner's analysis (export, federated) get ``sparse``; the analysis' gradient
step trains only the candidates and shares the model's weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pockengine.finetune import FinetuneConfig, finetune
from pockengine.scheme_choice import estimate as est
from pockengine.scheme_choice.gradient_sums import micro_rows
from pockengine.tasks import recipes
from pockengine.tasks.recipe_table import RECIPES
from tests.test_sensitivity import _dataset


def _scheme(auto: bool = True, **options: object) -> object:
    return recipes.defaults(FinetuneConfig(**options), auto=auto)["scheme"]  # type: ignore[arg-type]


def test_the_recipes_default_to_auto() -> None:
    for recipe in ("minilm-bbc", "minilm-tweets", "lite0-fashion", "smollm2-pydocs"):
        assert _scheme(recipe=recipe) == "auto"
        assert _scheme(recipe=recipe, auto=False) == "sparse"  # export, federated
    assert _scheme(recipe=None, model="some/folder", data="d.csv") == "auto"
    assert _scheme(recipe=None, model="tests.test_auto_scheme:wide_classifier",
                   data="d.csv") == "full"  # fmt: skip  # a factory trains from scratch
    # low-bit frozen weights ask for the least memory: auto's analysis holds the float
    # model, so such a run defaults to sparse (a given --scheme auto still analyses)
    for dtype in ("gguf", "int8", "int4"):
        assert _scheme(recipe="smollm2-pydocs", frozen_dtype=dtype) == "sparse"
    given = FinetuneConfig(recipe="smollm2-pydocs", frozen_dtype="gguf", scheme="auto")
    assert given.with_defaults(recipes.defaults(given)).scheme == "auto"
    # smollm2's auto rate was chosen on training examples (docs/quality.md), not sparse's
    smol = FinetuneConfig(recipe="smollm2-pydocs")
    assert recipes.defaults(smol)["lr"] == 3e-4 != RECIPES["smollm2-pydocs"].learning_rate("sparse")
    # lite0-fashion's BatchNorms normalise by their running statistics (docs/quality.md);
    # a given --batchnorm wins
    for recipe in RECIPES:
        mine = {"recipe": None, "model": "m", "data": "d.csv"}
        config = FinetuneConfig(**(mine if recipe == "generic" else {"recipe": recipe}))
        want = "running" if recipe == "lite0-fashion" else "batch"
        assert recipes.defaults(config)["batchnorm"] == want, recipe
    given = FinetuneConfig(recipe="lite0-fashion", batchnorm="batch")
    assert given.with_defaults(recipes.defaults(given)).batchnorm == "batch"
    # a new recipe decides its default here
    assert set(RECIPES) == {"minilm-bbc", "minilm-tweets", "lite0-fashion", "smollm2-pydocs",
                            "smollm2-pyqa", "generic", "generic-lm"}  # fmt: skip
    # the user's own causal LM on their text, instructions or chats: auto too
    assert _scheme(recipe="generic-lm", model="my-llm", data="chats.jsonl") == "auto"
    assert _scheme(recipe="generic-lm", model="my-llm", data="chats.jsonl", auto=False) == "sparse"
    # the recipe's default learning rate is auto's; sparse stays selectable
    bbc = FinetuneConfig(recipe="minilm-bbc")
    assert recipes.defaults(bbc)["lr"] == RECIPES["minilm-bbc"].learning_rate("auto")
    given = FinetuneConfig(recipe="minilm-bbc", scheme="sparse")
    filled = given.with_defaults(recipes.defaults(given))
    assert filled.scheme == "sparse" and filled.lr == RECIPES["minilm-bbc"].learning_rate("sparse")


def test_the_recipe_recomputation_budget_holds_auto_unless_a_budget_is_given() -> None:
    """auto's default budget is sparse's planned peak, so the recomputation budget set for
    sparse's step applies to it; under the user's --memory-budget it may not fit."""
    budget = RECIPES["minilm-bbc"].remat_budget(FinetuneConfig(recipe="minilm-bbc"))
    assert budget
    for scheme in (None, "auto", "sparse"):
        got = recipes.defaults(FinetuneConfig(recipe="minilm-bbc", scheme=scheme))
        assert got["remat_budget"] == budget, scheme
    given = FinetuneConfig(recipe="minilm-bbc", scheme="auto", memory_budget=float(400 << 20))
    assert "remat_budget" not in recipes.defaults(given)


def test_micro_batches_divide_the_batch() -> None:
    assert [micro_rows(16, m) for m in (1, 3, 4, 5, 16, 99)] == [1, 2, 4, 4, 16, 16]
    assert micro_rows(6, 4) == 3 and micro_rows(7, 4) == 1 and micro_rows(1, 0) == 1


def test_the_gradient_step_trains_the_candidates_only_on_the_models_memory(
    tmp_path: Path,
) -> None:
    from pockengine.frontend.torch import import_torch, torch_model_info

    config = FinetuneConfig(model="tests.test_auto_scheme:wide_classifier", recipe=None,
                            data=str(_dataset(tmp_path / "d.csv")), batch_size=8, seq_len=8,
                            backend="torch", scheme="auto")  # fmt: skip
    config = config.with_defaults(recipes.defaults(config)).validate()
    task = recipes.build(config)
    example = tuple(torch.from_numpy(a[:8]) for a in task.train)
    planner = est.Planner(torch_model_info(task.model),
                          lambda ev, rows: import_torch(task.model, task.loss_fn,
                                                        [a[:rows] for a in example], ev),
                          est.optimizer_of(config))  # fmt: skip
    step = planner.gradient_step("torch", ["fc2.weight"], 2)
    assert set(step.trained) == {"fc2.weight"}
    state = step.optimizer_state()  # SGD without momentum: its rate, no per-weight state
    assert all(np.size(v) == 1 for v in state.values()), state
    batch = [np.ascontiguousarray(a[:2]) for a in task.train]
    assert set(step.gradients(*batch)) == {"fc2.weight"}
    weights = step.flat_state_dict(["fc1.weight", "fc2.weight"], copy=False)
    for name, value in weights.items():  # shared, never copied: the step writes nothing
        assert np.shares_memory(value, task.model.get_parameter(name).detach().numpy()), name


def _bert(folder: Path) -> Path:
    """A three-block BERT folder (random weights, safetensors; sparse trains the last two
    blocks) with the words of ``_dataset`` as its vocabulary."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "goal", "match", "team", "score",
             "bank", "price", "loan", "tax", "the", "a", "of", "today", "news", "said"]  # fmt: skip
    config = BertConfig(vocab_size=len(words), hidden_size=8, num_hidden_layers=3,
                        num_attention_heads=2, intermediate_size=16,
                        max_position_embeddings=16)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    return folder


def test_a_default_run_of_a_model_folder_trains_the_auto_choice(tmp_path: Path) -> None:
    """``--model FOLDER --data CSV`` with no ``--scheme``: the analysis runs, the summary
    says what it chose, and the step trains the base and exactly the chosen weights."""
    model = _bert(tmp_path / "bert")
    config = FinetuneConfig(recipe=None, model=str(model), data=str(_dataset(tmp_path / "d.csv")),
                            batch_size=4, seq_len=8, max_train=16, epochs=1, backend="torch",
                            progress="none", compile_in="process",
                            out=str(tmp_path / "run"))  # fmt: skip
    result = finetune(config)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["scheme"] == "auto"
    auto = summary["auto_scheme"]
    assert auto["budget_source"] == "the sparse scheme's planned peak"
    chosen = {c["param"] for c in auto["candidates"] if c["ratio"]}
    assert auto["candidates"] and chosen  # weights were scored, some chosen
    trained = set(result.step.trained)
    base = {n for n in trained if n.endswith(".bias") or "LayerNorm" in n or n.startswith("head")}
    assert trained - base == chosen
    assert result.planned_peak_bytes <= auto["budget_bytes"]
    assert "auto scheme: bias +" in result.summary()
