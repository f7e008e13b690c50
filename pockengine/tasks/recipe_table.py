"""The recipe table, without torch: what each recipe is, its defaults and schemes.

``pockengine finetune`` checks its options, takes the run folder's lock and (with
``--compile-in child``) waits for the compile child before it imports torch: everything
it needs until then is here. The recipes' task builders live in
``pockengine.tasks.recipes`` (which imports torch), in its ``BUILDERS`` by recipe name:
``Recipe.build`` imports them when it is called.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pockengine.ir import SchemeError
from pockengine.sparse import schemes
from pockengine.sparse.schemes import SCHEME_FILES, Scheme, running_statistics, scheme_named
from pockengine.tasks.config import FinetuneConfig, FinetuneError
from pockengine.tasks.lm_kind import wants_lm
from pockengine.tasks.model_files import (
    check_model_folder,
    check_tokenizer_folder,
    has_tokenizer,
    is_factory_spec,
)

if TYPE_CHECKING:
    from pockengine.tasks.task import Task

__all__ = [
    "RECIPES",
    "Recipe",
    "check_model_files",
    "defaults",
    "parse_scheme",
    "recipe_name",
]

_BUILDERS = "pockengine.tasks.recipes"

# AdamW learning rates by scheme name: the fewer (and the more freshly initialised) the
# trained params, the larger the step they take. SGD defaults to ten times these.
_ADAMW_LR = {
    "full": 1e-4,
    "sparse": 5e-4,
    "auto": 5e-4,  # as sparse: biases, norms, the head and some weights
    "last": 5e-4,
    "bias": 2e-3,
    "bias-only": 2e-3,
    "head": 1e-2,
    "lora": 5e-3,  # beat 1e-3 on minilm-bbc (benchmarks/lora_peer.py); no sweep
}


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning recipe: what it is, the config defaults it brings, its AdamW
    learning rate by scheme name (names it lacks take ``_ADAMW_LR``'s) and what ``--scheme
    sparse`` trains for its model. Its task builder is ``recipes.BUILDERS[name]``."""

    name: str
    about: str
    defaults: Mapping[str, Any]
    lr: Mapping[str, float] = field(default_factory=dict)
    sparse: Scheme = field(default_factory=schemes.sparse)
    lora_head: bool = True  # whether ``--scheme lora`` trains the head (a new one must)
    # The planned peak its sparse step is held to by recomputation (bit-identical results),
    # chosen for its own batch shape: another shape or scheme runs without one by default.
    # Each budget is (settings, bytes): the first whose settings the run has applies, as a
    # budget measured with 4-bit frozen weights cannot be met by float32 ones.
    remat_budgets: tuple[tuple[Mapping[str, str], int], ...] = ()

    def build(self, config: FinetuneConfig) -> Task:
        """The task: the model, and the data encoded for it (a tokenizer belongs to the
        model), built by ``recipes.BUILDERS[name]``, imported now (with torch)."""
        task: Task = importlib.import_module(_BUILDERS).BUILDERS[self.name](config)
        return task

    def remat_budget(self, config: FinetuneConfig) -> int | None:
        """The recomputation budget for ``config``'s settings (None: the first matching
        entry of ``remat_budgets``, none matching)."""
        for settings, budget in self.remat_budgets:
            if all(getattr(config, k) == v for k, v in settings.items()):
                return budget
        return None

    def learning_rate(self, scheme: str) -> float:
        """The AdamW rate of a scheme name (``last:K`` is ``last``), or of a scheme file's
        kind (a ``{"scheme": "sparse", "channels": 0.5}`` file gets the sparse rate);
        kinds without a rate of their own (``select``, ``union``, ...) get 1e-3."""
        is_file = Path(scheme).suffix in SCHEME_FILES
        kind = schemes.load(scheme).kind if is_file else scheme.split(":")[0]
        return self.lr.get(kind, _ADAMW_LR.get(kind, 1e-3))


# -- choosing ------------------------------------------------------------------------


def recipe_name(config: FinetuneConfig) -> str:
    """The recipe a config asks for (``generic`` when it names a model or dataset,
    ``generic-lm`` when that model is a causal LM or ``--task lm`` says so)."""
    if config.recipe is None:
        return "generic-lm" if wants_lm(config) else "generic"
    if config.recipe not in RECIPES:
        raise FinetuneError(f"unknown recipe {config.recipe!r}; recipes: {', '.join(RECIPES)}")
    if config.recipe not in _OWN_DATA and (config.model or config.data):
        raise FinetuneError(
            f"recipe {config.recipe} brings its own model and data; "
            "drop --model/--data, or drop the recipe to use yours"
        )
    return config.recipe


def defaults(config: FinetuneConfig, *, auto: bool = True) -> dict[str, Any]:
    """The defaults of the config's recipe, with the learning rate for its scheme.
    ``auto=False``: for commands that compile a scheme without the fine-tuner's analysis
    (export, federated), whose default is ``sparse`` where the recipe's is ``auto``."""
    recipe = RECIPES[recipe_name(config)]
    out = {"scheme": "sparse", "batchnorm": "batch", **recipe.defaults}
    # A run with low-bit frozen weights asks for the least memory: auto's analysis holds
    # the float model (on smollm2-pydocs with GGUF weights and 8-bit state its process
    # peaks at about 1.9 GB against the training process's 0.9), so it defaults to
    # sparse there; --scheme auto still analyses (docs/quality.md).
    low_bit = config.frozen_dtype not in ("none", None)
    if out["scheme"] == "auto" and (not auto or low_bit):
        out["scheme"] = "sparse"
    lr = None
    if recipe.name == "generic" and config.model and is_factory_spec(config.model):
        out["scheme"], lr = "full", 1e-3  # a factory model trains from scratch
    scheme = config.scheme or out["scheme"]
    lr = lr or recipe.learning_rate(scheme)
    out["lr"] = lr * 10 if config.optimizer == "sgd" else lr
    own_shape = all(getattr(config, k) in (None, out.get(k)) for k in ("batch_size", "seq_len"))
    budget = recipe.remat_budget(config)
    # auto's choice plans at most sparse's peak (its default budget): the same
    # recomputation budget holds it, not one under a --memory-budget of the user's
    ours = scheme == "sparse" or (scheme == "auto" and config.memory_budget is None)
    if budget is not None and own_shape and ours:
        out["remat_budget"] = budget
    return out


def parse_scheme(spec: str, recipe: str | None = None, batchnorm: str | None = "batch") -> Scheme:
    """The scheme a name (``pockengine.sparse.schemes``: full, bias, bias-only, sparse, head,
    last:K) or a scheme file stands for; ``sparse`` is the recipe's own. Named schemes run
    BatchNorm layers that train nothing on their running statistics (``frozen_bn="eval"``):
    a short fine-tune barely moves those statistics, so layers trained on batch
    statistics would meet different ones at evaluation. ``batchnorm="running"`` (the
    config's ``--batchnorm``) runs the trained ones on theirs too."""
    own = RECIPES[recipe].sparse if recipe in RECIPES else None
    head = RECIPES[recipe].lora_head if recipe in RECIPES else True
    try:
        scheme = scheme_named(spec, sparse=own, frozen_bn="eval", lora_head=head)
    except SchemeError as exc:
        raise FinetuneError(str(exc)) from exc
    return with_batchnorm(scheme, batchnorm)


def with_batchnorm(scheme: Scheme, batchnorm: str | None) -> Scheme:
    """``scheme`` with every BatchNorm on its running statistics when ``batchnorm`` says
    "running" (``schemes.running_statistics``); as it is otherwise (None: a config whose
    recipe defaults are not filled in, "batch" then)."""
    return running_statistics(scheme) if batchnorm == "running" else scheme


def check_model_files(config: FinetuneConfig) -> None:
    """The generic path's model and tokenizer folders, checked before any work starts:
    nothing in them executes, weights are whole safetensors, a tokenizer exists."""
    if recipe_name(config) not in _OWN_DATA or config.model is None:
        return
    if config.tokenizer:
        check_tokenizer_folder(config.tokenizer)
    if is_factory_spec(config.model) or not Path(config.model).is_dir():
        return
    check_model_folder(Path(config.model))
    if not config.tokenizer and not has_tokenizer(Path(config.model)):
        raise FinetuneError(
            f"{config.model} has no tokenizer files (tokenizer.json, vocab.txt, ...): training "
            "would see unknown-token ids only; give one with --tokenizer FOLDER"
        )


# The LLM recipe: every norm, and the output projection of every attention and MLP
# sub-block. A causal LM adapting to new text needs its early blocks: on smollm2-pydocs the
# last 2 (or 10) of 30 blocks stay far from full fine-tuning's perplexity, while these
# 20% of the weights, spread over all blocks, come close. Backprop runs to the first
# block, but weight gradients and AdamW state exist for those weights only.
_LM_SPARSE = ("*norm*", "*.mlp.down_proj.weight", "*.self_attn.o_proj.weight")


_OWN_DATA = ("generic", "generic-lm")  # the recipes of the user's own --model and --data
_SEQ = {"epochs": 1, "batch_size": 16}
# Every recipe trains the scheme a gradient estimate chooses under sparse's planned peak
# (docs/quality.md); ``--scheme sparse`` trains the fixed rule.
_AUTO = {"scheme": "auto"}
# minilm-bbc's sparse step (16 x 128 tokens) plans 516 MiB, 366 of them saved activations:
# recomputing to fit 300 MiB costs 17% more FLOPs, no measurable step time, and lowers the
# run's peak by ~250 MiB (benchmarks/run_memory.py measures it); results
# are bit for bit the same. --remat-budget 4GB (above the plan) turns it off.
_MINILM_BBC_REMAT = 300 << 20
# smollm2-pydocs' sparse step (4 x 128 tokens) with GGUF frozen weights plans 1164 MiB, 566
# of them saved activations: fitting 700 MiB recomputes 16.8% of the step's FLOPs and lowers
# the whole-process peak from 2012 to 1666 MiB; with 8-bit AdamW state (208 MiB less),
# 450 MiB recomputes 18.7% (docs/quant.md). Float32 frozen weights (540 MiB) fit neither.
_SMOLLM2_REMAT = (
    ({"frozen_dtype": "gguf", "optimizer_state": "int8"}, 450 << 20),
    ({"frozen_dtype": "gguf"}, 700 << 20),
)
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "minilm-bbc",
            "all-MiniLM-L6-v2 + linear head on BBC News topics (5 classes)",
            {**_SEQ, **_AUTO, "epochs": 2, "seq_len": 128},
            remat_budgets=(({}, _MINILM_BBC_REMAT),),
        ),
        # 37k tweets: a subset by default, so that a NumPy-backend run ends the same day
        Recipe(
            "minilm-tweets",
            "all-MiniLM-L6-v2 + linear head on tweet sentiment (3 classes)",
            {**_SEQ, **_AUTO, "seq_len": 64, "max_train": 4000, "max_val": 1000},
        ),
        # Every BatchNorm on its running statistics: at these defaults sparse's validation
        # accuracy is 0.824 / 0.812 (seeds 0, 1) against 0.608 / 0.708 on batch
        # statistics, at the same planned peak (docs/quality.md, lite0-fashion). auto:
        # on held-out test images it ties sparse at these defaults
        # (82.0 against 81.8, three seeds) and leads by 1.7 points over 5 epochs at 32 px
        Recipe(
            "lite0-fashion",
            "EfficientNet-Lite0 (ImageNet) + new head on Fashion-MNIST (10 classes)",
            {
                **_SEQ,
                **_AUTO,
                "image_size": 64,
                "max_train": 2000,
                "max_val": 500,
                "batchnorm": "running",
            },
        ),
        # 135M params: a few steps of a few chunks by default (about 20 s a step on NumPy).
        # Learning rates from 100-step sweeps (docs/finetune.md); auto's chosen on
        # training examples (docs/quality.md, smollm2-pydocs); the head is the tied
        # embedding, which auto may train in part. auto: test perplexity
        # 18.91 against sparse's 20.36 and full's 19.42 (three seeds), at sparse's peak
        Recipe(
            "smollm2-pydocs",
            "SmolLM2-135M-Instruct (GGUF) as a causal LM on the Python 3.11 docs",
            {**_AUTO, "epochs": 1, "batch_size": 4, "seq_len": 128, "max_train": 64, "max_val": 32},
            lr={
                "full": 1e-4,
                "sparse": 5e-4,
                "auto": 3e-4,
                "bias": 1e-4,
                "head": 1e-4,
                "lora": 5e-4,
            },
            sparse=schemes.select(_LM_SPARSE),
            lora_head=False,  # the head is the pretrained (tied) embedding
            remat_budgets=_SMOLLM2_REMAT,
        ),
        # Instruction tuning on question/answer pairs derived from the Python docs
        # (instruct_data), the held-out test split never read by a choice; smollm2-pydocs'
        # scheme rules and learning rates
        Recipe(
            "smollm2-pyqa",
            "SmolLM2-135M-Instruct (GGUF) instruction-tuned on Python-docs question/answer pairs",
            {
                **_AUTO,
                "epochs": 1,
                "batch_size": 4,
                "seq_len": 256,
                "max_train": 192,
                "max_val": 48,
            },
            lr={
                "full": 1e-4,
                "sparse": 5e-4,
                "auto": 3e-4,
                "bias": 1e-4,
                "head": 1e-4,
                "lora": 5e-4,
            },
            sparse=schemes.select(_LM_SPARSE),
            lora_head=False,  # the head is the pretrained (tied) embedding
        ),
        # Your own causal LM on your own text, instructions or chats (lm_task): SmolLM2's
        # scheme rules and learning rates (the sweep above), packed 256-token rows
        Recipe(
            "generic-lm",
            "--model (a causal-LM folder or .gguf) on --data (text, prompt/completion, "
            "Alpaca or chat JSONL; .txt/.md)",
            {**_AUTO, "epochs": 1, "batch_size": 4, "seq_len": 256},
            lr={
                "full": 1e-4,
                "sparse": 5e-4,
                "auto": 3e-4,
                "bias": 1e-4,
                "head": 1e-4,
                "lora": 5e-4,
            },
            sparse=schemes.select(_LM_SPARSE),
            lora_head=False,  # the head is the pretrained output projection
        ),
        Recipe(
            "generic",
            "--model (Hugging Face folder or module:factory) on --data (CSV/JSONL/folder)",
            {**_AUTO, "epochs": 3, "batch_size": 16, "seq_len": 128},
        ),
    )
}
