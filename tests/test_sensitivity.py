"""Contribution analysis on a tiny factory model and a synthetic two-topic dataset:
one record per candidate with its contribution and costs, costs that grow with the
channel ratio, a cache that resumes, and the search command end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from pockengine.cli import main
from pockengine.finetune import FinetuneConfig, finetune
from pockengine.scheme_choice.sensitivity import (
    COST_FIELDS,
    AnalysisSettings,
    StepBuilder,
    run_analysis,
)
from pockengine.sparse import schemes

RATIOS = (0.125, 0.25, 0.5, 1.0)
FACTORY = "tests.test_sensitivity:tiny_classifier"


class TinyClassifier(nn.Module):
    """Embedding, mean pool, two hidden Linear layers, a Linear head."""

    def __init__(self, vocab_size: int, num_labels: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, num_labels)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(torch.float32)
        h = (self.embed(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        h = torch.relu(self.fc1(h))
        h = torch.relu(self.fc2(h))
        out: torch.Tensor = self.head(h)
        return out


def tiny_classifier(vocab_size: int, num_labels: int) -> nn.Module:
    return TinyClassifier(vocab_size, num_labels)


def _dataset(path: Path) -> Path:
    """Two topics told apart by their words, with shared filler."""
    rng = random.Random(0)
    words = {"sport": ["goal", "match", "team", "score"], "money": ["bank", "price", "loan", "tax"]}
    filler = ["the", "a", "of", "today", "news", "said"]
    rows = ["text,label"]
    for i in range(120):
        label = "sport" if i % 2 else "money"
        text = rng.choices(words[label], k=3) + rng.choices(filler, k=4)
        rng.shuffle(text)
        rows.append(f"{' '.join(text)} {i},{label}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _config(tmp_path: Path) -> FinetuneConfig:
    return FinetuneConfig(model=FACTORY, data=str(_dataset(tmp_path / "topics.csv")),
                          recipe=None, batch_size=8, seq_len=8, max_train=72,
                          backend="torch", progress="none")  # fmt: skip


SETTINGS = AnalysisSettings(steps=6, holdout=24, lr=1e-2, threads=1)


def test_one_record_per_candidate_with_costs_monotone_in_the_ratio(tmp_path: Path) -> None:
    analysis = run_analysis(_config(tmp_path), SETTINGS, ratios=RATIOS, workers=1,
                            cache_dir=tmp_path / "cache", progress=False)  # fmt: skip
    keys = [r.key for r in analysis.records]
    expected = ["bias:fc1", *(f"weight:fc1@{r:g}" for r in RATIOS),
                "bias:fc2", *(f"weight:fc2@{r:g}" for r in RATIOS)]  # fmt: skip
    assert keys == expected  # the embedding has no bias and no output channels; head: base
    assert set(analysis.baselines) == {"head", "bias"}
    rows = analysis.rows()
    for row in rows:
        assert 0.0 <= row["val_accuracy"] <= 1.0
        assert row["contribution"] == pytest.approx(
            row["val_accuracy"] - analysis.baselines[row["baseline"]].val_accuracy
        )
        assert set(row["extra"]) == set(COST_FIELDS)
        assert row["extra"]["trained_elements"] > 0  # every candidate trains something more
    for layer in ("fc1", "fc2"):
        weights = [r for r in rows if r["kind"] == "weight" and r["layer"] == layer]
        assert [r["ratio"] for r in weights] == list(RATIOS)
        for key in COST_FIELDS:
            series = [r["extra"][key] for r in weights]
            assert series == sorted(series), (layer, key, series)
        grads = [r["extra"]["gradient_bytes"] for r in weights]  # 2, 4, 8, 16 rows of 16
        assert grads == [grads[-1] // 8, grads[-1] // 4, grads[-1] // 2, 16 * 16 * 4]
    # The head-only baseline reads no activation gradient below the head; fc1's biases do.
    assert analysis.baselines["head"].costs["backward_flops"] < (
        analysis.baselines["head"].costs["backward_flops"]
        + next(r for r in rows if r["key"] == "bias:fc1")["extra"]["backward_flops"]
    )
    table = json.loads((analysis.folder / "table.json").read_text())
    assert [r["key"] for r in table] == keys


def test_the_cache_resumes_without_retraining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, cache = _config(tmp_path), tmp_path / "cache"
    ratios = (0.5, 1.0)
    first = run_analysis(config, SETTINGS, ratios=ratios, workers=1, cache_dir=cache,
                         progress=False)  # fmt: skip
    lost = next(first.folder.glob("weight_fc2@1-*.json"))
    lost.unlink()  # as if the analysis had been interrupted before this candidate
    measured: list[str] = []
    original = StepBuilder.measure

    def counting(self: StepBuilder, c: object) -> object:
        measured.append(c.key)  # type: ignore[attr-defined]
        return original(self, c)  # type: ignore[arg-type]

    monkeypatch.setattr(StepBuilder, "measure", counting)
    second = run_analysis(config, SETTINGS, ratios=ratios, workers=1, cache_dir=cache,
                          progress=False)  # fmt: skip
    assert measured == ["weight:fc2@1"]
    assert second.rows() == first.rows() or [r["key"] for r in second.rows()] == [
        r["key"] for r in first.rows()
    ]
    again = run_analysis(config, SETTINGS, ratios=ratios, workers=1, cache_dir=cache,
                         progress=False)  # fmt: skip
    assert measured == ["weight:fc2@1"] and again.rows() == second.rows()
    other = AnalysisSettings(steps=7, holdout=24, lr=1e-2, threads=1)  # new settings: new folder
    assert run_analysis(config, other, ratios=(1.0,), layers=("fc2",), workers=1,
                        cache_dir=cache, progress=False).folder != first.folder  # fmt: skip


@pytest.mark.slow  # two spawned processes import torch: ~20 s on a busy 2-core machine
def test_worker_processes_measure_the_same_as_this_process(tmp_path: Path) -> None:
    config = _config(tmp_path)
    local = run_analysis(config, SETTINGS, ratios=(1.0,), layers=("fc2",), workers=1,
                         cache_dir=tmp_path / "a", progress=False)  # fmt: skip
    pooled = run_analysis(config, SETTINGS, ratios=(1.0,), layers=("fc2",), workers=2,
                          cache_dir=tmp_path / "b", progress=False)  # fmt: skip
    for a, b in zip(local.rows(), pooled.rows(), strict=True):
        assert a["key"] == b["key"] and a["costs"] == b["costs"]
        assert a["val_accuracy"] == pytest.approx(b["val_accuracy"], abs=1 / 24)


def test_search_command_writes_a_scheme_within_budget_that_finetunes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = _dataset(tmp_path / "topics.csv")
    out = tmp_path / "scheme.yaml"
    common = ["--model", FACTORY, "--data", str(data), "--batch-size", "8", "--seq-len", "8",
              "--max-train", "72", "--backend", "torch"]  # fmt: skip
    budget = 48 * 1024  # bytes: above the head-only step of this model, below full backprop
    args = ["search", *common, "--memory-budget", f"{budget / 1024:g}KB", "--out", str(out),
            "--cache-dir", str(tmp_path / "cache"), "--steps", "6", "--holdout", "24",
            "--analysis-lr", "0.01", "--workers", "1", "--ratios", "0.5", "1",
            "--progress", "none"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(Path(f"{out}.search.json").read_text())
    assert summary["measured"]["memory"] <= budget
    assert Path(f"{out}.png").stat().st_size > 0
    scheme = schemes.load(out)
    assert scheme.to_dict() == summary["scheme"]
    builder = StepBuilder(FinetuneConfig(model=FACTORY, data=str(data), recipe=None,
                                         batch_size=8, seq_len=8, max_train=72),
                          SETTINGS)  # fmt: skip
    assert builder.figures(scheme).planned_peak_bytes == summary["measured"]["memory"]
    result = finetune(model=FACTORY, data=str(data), scheme=str(out), batch_size=8, seq_len=8,
                      max_train=72, epochs=1, backend="torch", progress="none",
                      out=str(tmp_path / "run"))  # fmt: skip
    assert result.finished and result.final["val_accuracy"] >= 0.0
