"""Hugging Face coverage: tiny random configs of many ``transformers`` architectures compile,
and their loss and every gradient match torch.autograd (an op the frontend lacks is an
UnsupportedOpError naming the op and the module path: tests/test_frontend_torch.py).
docs/coverage.md is the table of the same list (checked here, so the two cannot drift).

The fast architectures run by default; ``pytest -m slow tests/test_hf_coverage.py`` runs all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pockengine import zoo
from tests.hf_models import ARCHITECTURES, Arch
from tests.torch_ref import assert_gradients_match

_DOC = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"


def _param(a: Arch) -> object:
    return pytest.param(a, id=a.name, marks=() if a.fast else (pytest.mark.slow,))


@pytest.mark.parametrize("arch", [_param(a) for a in ARCHITECTURES])
def test_architecture_matches_autograd(arch: Arch) -> None:
    work = arch.build()
    if arch.double:
        assert_gradients_match(zoo.as_double(work), rtol=1e-7, atol=1e-10)
    else:
        assert_gradients_match(work)


def test_fast_set_spans_the_families() -> None:
    fast = {a.family for a in ARCHITECTURES if a.fast}
    assert {"encoder", "decoder", "vision"} <= fast
    assert sum(a.fast for a in ARCHITECTURES) >= 5
    assert len(ARCHITECTURES) >= 20


def test_coverage_doc_lists_every_architecture() -> None:
    rows = re.findall(r"^\| `([\w-]+)` \| ([\w-]+) \| (\w+)", _DOC.read_text(), re.MULTILINE)
    table = {name: (family, status) for name, family, status in rows}
    expected = {a.name: (a.family, "matches") for a in ARCHITECTURES}
    assert table == expected
