"""One scheme vocabulary: each name trains the same parameters in ``pockengine inspect`` /
``export`` (``cli._scheme``), ``finetune`` / ``search`` (``recipes.parse_scheme``), the
benchmarks (``zoo.benchmark_schemes``) and the API (``pe.schemes.named``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pockengine as pe
from pockengine import cli, zoo
from pockengine.frontend.imported import ModelInfo
from pockengine.frontend.torch import torch_model_info
from pockengine.ir import SchemeError
from pockengine.sparse.schemes import SCHEME_NAMES, scheme_named
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneError

_DOC = Path(__file__).resolve().parents[1] / "docs" / "sparse_backprop.md"


def _trained(scheme: pe.schemes.Scheme, info: ModelInfo) -> set[str]:
    return pe.schemes.resolve_scheme(scheme, info).names


@pytest.mark.parametrize("name", ["full", "bias", "bias-only", "head", "last:1"])
def test_a_name_trains_the_same_params_everywhere(name: str) -> None:
    info = torch_model_info(zoo.bert_classifier().model)
    api = pe.schemes.named(name)
    assert cli._scheme(name, "bert") == api
    assert recipes.parse_scheme(name, "minilm-bbc") == api
    assert recipes.parse_scheme(name, "smollm2-pydocs") == api
    assert _trained(api, info)


def test_bias_trains_the_head_and_bias_only_does_not() -> None:
    info = torch_model_info(zoo.bert_classifier().model)
    head = _trained(pe.schemes.named("head"), info)
    bias, bias_only = (
        _trained(scheme_named("bias"), info),
        _trained(scheme_named("bias-only"), info),
    )
    assert bias == bias_only | head and head == {"head.weight", "head.bias"}
    assert "head.weight" not in bias_only
    assert bias_only == _trained(pe.schemes.bias_only(), info)


def test_sparse_is_the_model_s_own_recipe() -> None:
    info = torch_model_info(zoo.bert_classifier(layers=4).model)
    mbv2 = zoo.benchmark_schemes("mbv2")["sparse"]
    assert mbv2.options["blocks"] == zoo.RECIPE_BLOCKS["mbv2"] == 4
    assert cli._scheme("sparse", "mbv2").options == mbv2.options
    assert cli._scheme("sparse", "bert", "train") == zoo.benchmark_schemes("bert")["sparse"]
    default = _trained(scheme_named("sparse"), info)  # the last 2 blocks
    assert any(".layer.2." in n and n.endswith("weight") for n in default)
    assert not any(".layer.1." in n and "dense.weight" in n for n in default)
    llm = recipes.parse_scheme("sparse", "smollm2-pydocs")
    assert llm == scheme_named("sparse", sparse=recipes.RECIPES["smollm2-pydocs"].sparse)
    assert llm.kind == "select"


def test_named_schemes_freeze_batchnorm_statistics_unless_asked() -> None:
    assert scheme_named("bias").frozen_bn == "eval"
    assert scheme_named("sparse", frozen_bn="train").frozen_bn == "train"
    assert all(s.frozen_bn == "train" for s in zoo.benchmark_schemes("mbv2").values())


def test_bad_names_are_clear_errors() -> None:
    with pytest.raises(SchemeError, match=r"unknown scheme 'bias_only'.*bias-only"):
        scheme_named("bias_only")
    with pytest.raises(SchemeError, match="whole number"):
        pe.schemes.named("last:two")
    with pytest.raises(FinetuneError, match="unknown scheme 'sparce'"):
        recipes.parse_scheme("sparce")
    assert cli.main(["inspect", "mlp", "--scheme", "nope"]) == 2


def test_scheme_files_are_loaded_by_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    pe.schemes.save(pe.schemes.select(train=["head.*"]), path)
    assert (
        cli._scheme(str(path), "bert") == recipes.parse_scheme(str(path)) == pe.schemes.load(path)
    )


def test_the_docs_table_lists_every_name() -> None:
    section = _DOC.read_text().split("## Scheme names", 1)[1]
    documented = re.findall(r"^\| `([\w:-]+)` \|", section, re.MULTILINE)
    assert documented == list(SCHEME_NAMES)


def test_every_recipe_is_one_record() -> None:
    for name, recipe in recipes.RECIPES.items():
        assert recipe.name == name and recipe.about and callable(recipe.build)
        assert recipe.sparse.kind in ("sparse", "select")
    lm = recipes.RECIPES["smollm2-pydocs"]
    assert lm.learning_rate("bias") == 1e-4 and lm.learning_rate("last:3") == 5e-4
    assert recipes.RECIPES["minilm-bbc"].learning_rate("bias-only") == 2e-3


def test_a_scheme_file_takes_its_kinds_learning_rate(tmp_path: Path) -> None:
    """A file of a named kind gets that kind's rate (a partial-channel ``sparse`` file is
    still ``sparse``); a kind without one gets 1e-3; a broken file is a SchemeError."""
    bbc = recipes.RECIPES["minilm-bbc"]
    channels = tmp_path / "c50.json"
    channels.write_text('{"scheme": "sparse", "channels": 0.5}')
    assert bbc.learning_rate(str(channels)) == bbc.learning_rate("sparse") != 1e-3
    select = tmp_path / "select.yaml"
    select.write_text("scheme: select\ntrain: ['*bias']\n")
    assert bbc.learning_rate(str(select)) == 1e-3
    with pytest.raises(SchemeError, match=r"missing\.json"):
        bbc.learning_rate(str(tmp_path / "missing.json"))
