"""After the run: RUN/model in its home format, pe.load_run, pockengine evaluate/predict/generate.

A short head-only run of the default recipe (minilm-bbc) on a small subset is loaded back
through transformers and through pe.load_run, evaluated and predicted on; the tiny factory
model of the resume tests checks module:factory runs, the word vocabulary and --keep
best/last; a tiny CNN stands in for the vision recipe. The causal LM: test_run_model_lm.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import pockengine as pe
from pockengine import zoo
from pockengine.cli import main
from pockengine.finetune.run_folder import checkpoint, home
from pockengine.finetune.running import loop
from tests.test_finetune_resume import write_task

TEXTS = ["The central bank raised interest rates again", "The striker scored twice in the final"]


def _run(out: Path, *options: str) -> None:
    assert main(["finetune", *options, "--progress", "none", "--out", str(out)]) == 0


def _predict_cli(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["predict", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.fixture(scope="module")
def bbc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("after") / "bbc"
    _run(
        out,
        "--recipe",
        "minilm-bbc",
        "--scheme",
        "head",
        "--lr",
        "0.02",
        "--max-train",
        "48",
        "--max-val",
        "24",
        "--seq-len",
        "32",
        "--epochs",
        "1",
    )
    return out


def test_classifier_model_loads_in_transformers_with_the_trained_weights(bbc: Path) -> None:
    from transformers import AutoModel

    saved = checkpoint.load(bbc / checkpoint.CHECKPOINT).params  # the engine's values
    head = load_file(str(bbc / "model" / "head.safetensors"))
    np.testing.assert_array_equal(head["weight"], saved["head.weight"])
    np.testing.assert_array_equal(head["bias"], saved["head.bias"])
    encoder = AutoModel.from_pretrained(str(bbc / "model"), local_files_only=True)
    state = encoder.state_dict()
    for name, array in saved.items():
        if name.startswith("encoder."):
            np.testing.assert_array_equal(state[name.removeprefix("encoder.")].numpy(), array)
    source = load_file(str(zoo.minilm_path() / "model.safetensors"))  # the pooler, unchanged
    np.testing.assert_array_equal(
        state["pooler.dense.weight"].numpy(), source["pooler.dense.weight"]
    )
    meta = json.loads((bbc / "model" / "pockengine.json").read_text())
    assert meta["labels"] == ["business", "entertainment", "politics", "sports", "tech"]
    assert meta["pooling"] == "mean" and meta["seq_len"] == 32 and meta["weights"]["keep"] == "best"


def test_load_run_predict_agrees_with_the_cli(
    bbc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = pe.load_run(bbc)
    assert not loaded.model.training and loaded.labels[0] == "business"
    ours = loaded.predict(TEXTS)
    assert _predict_cli(capsys, str(bbc), *TEXTS) == ours
    assert [p["label"] for p in ours] == ["business", "sports"]
    assert all(abs(sum(p["probs"].values()) - 1) < 1e-4 for p in ours)
    # the same logits as the trained torch model of the run, rebuilt by hand
    saved = checkpoint.load(bbc / checkpoint.CHECKPOINT).params
    ids, mask = loaded.encode(TEXTS)
    probs = torch.softmax(loaded.logits(TEXTS), -1).numpy()
    encoder_out = loaded.model.encoder(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
    ).last_hidden_state
    w = torch.from_numpy(mask).unsqueeze(-1).float()
    pooled = ((encoder_out * w).sum(1) / w.sum(1)).detach().numpy()
    logits = pooled @ saved["head.weight"].T + saved["head.bias"]
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_predict_reads_a_file_and_writes_json_lines(
    bbc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "new.jsonl"
    inputs.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "predictions.jsonl"
    assert _predict_cli(capsys, str(bbc), "--input", str(inputs), "--output", str(out)) == []
    lines = [json.loads(s) for s in out.read_text().splitlines()]
    assert lines == pe.load_run(bbc).predict(TEXTS)


def test_evaluate_equals_the_runs_validation(bbc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", str(bbc)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((bbc / "eval.json").read_text())
    final = json.loads((bbc / "summary.json").read_text())["final"]
    # evaluate runs the saved model eagerly, the run's validation the compiled forward
    assert result["accuracy"] == final["val_accuracy"]
    assert result["loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    confusion = np.array(result["confusion"])
    assert confusion.shape == (5, 5) and confusion.sum() == result["examples"] == 24
    assert np.trace(confusion) / confusion.sum() == result["accuracy"]
    support = {k: v["support"] for k, v in result["per_class"].items()}
    assert list(support.values()) == confusion.sum(1).tolist()
    assert 0 < result["macro_f1"] <= 1 and "macro-F1" in printed and "sports" in printed
    assert (bbc / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_on_a_file_and_its_errors(bbc: Path, tmp_path: Path) -> None:
    data = tmp_path / "more.csv"
    data.write_text(
        "text,label\n"
        + "".join(f'"{t}",{y}\n' for t, y in zip(TEXTS, ("business", "sports"), strict=True))
    )
    assert main(["evaluate", str(bbc), "--data", str(data)]) == 0
    result = json.loads((bbc / "eval.json").read_text())
    assert result["examples"] == 2 and result["accuracy"] == 1.0 and result["data"] == str(data)
    data.write_text('text,label\n"a text",weather\n"b",tech\n')
    assert main(["evaluate", str(bbc), "--data", str(data)]) == 2
    with pytest.raises(pe.FinetuneError, match="holds no fine-tuned model"):
        pe.load_run(tmp_path)


def test_wrong_command_for_the_model(bbc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["generate", str(bbc), "--prompt", "Once"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and "is a classifier" in printed.err and "predict" in printed.err
    assert main(["predict", str(bbc)]) == 2
    assert "texts or --input" in capsys.readouterr().err


def test_the_documented_snippet_rebuilds_the_classifier(
    bbc: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (bbc / "model" / "README.txt").read_text()
    snippet = home.classifier_snippet(bbc)
    assert snippet in readme and len(snippet.strip().splitlines()) == 5
    docs = Path(__file__).parents[1] / "docs" / "finetune.md"
    assert home.classifier_snippet("RUN") in docs.read_text()
    capsys.readouterr()
    exec(compile(snippet, "snippet", "exec"), {})
    assert capsys.readouterr().out.strip() == pe.load_run(bbc).predict(["A new text"])[0]["label"]


# -- module:factory, the word vocabulary, --keep ------------------------------------------


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.syspath_prepend(str(tmp_path))
    return {**write_task(tmp_path), "epochs": 3, "max_train": 64}


def test_factory_model_under_its_state_dict_names(tmp_path: Path, task: dict[str, Any]) -> None:
    out = tmp_path / "bag"
    pe.finetune(**task, out=str(out), keep="last")
    weights = load_file(str(out / "model" / "model.safetensors"))
    saved = checkpoint.load(out / checkpoint.CHECKPOINT).params
    assert weights.keys() == saved.keys() == {"emb.weight", "head.weight", "head.bias"}
    for name in weights:
        np.testing.assert_array_equal(weights[name], saved[name])
    (tmp_path / "reviews.csv").unlink()  # predicting needs the run folder only
    loaded = pe.load_run(out, factory=task["model"])
    assert loaded.labels == ("neg", "pos") and type(loaded.model).__name__ == "Bag"
    ids, mask = loaded.encode(["a superb film", "an awful plot"])
    assert ids[0, 1] > 1 and mask.sum() == 6  # known words, no padding counted
    assert [p["label"] for p in loaded.predict(["superb great film", "awful terrible plot"])] == [
        "pos",
        "neg",
    ]


def _scripted(monkeypatch: pytest.MonkeyPatch, accuracies: list[float]) -> list[dict[str, Any]]:
    """Validation reports the given accuracies, in turn; returns each epoch's weights."""
    seen: list[dict[str, Any]] = []
    real = loop.evaluate
    script = iter(accuracies)

    def evaluate(step: Any, task: Any, **options: Any) -> dict[str, float]:
        metrics = {**real(step, task, **options), "val_accuracy": next(script)}
        seen.append(step.flat_state_dict())  # the values validated (the step's own)
        return metrics

    monkeypatch.setattr(loop, "evaluate", evaluate)
    return seen


def _model_weights(out: Path) -> dict[str, Any]:
    return load_file(str(out / "model" / "model.safetensors"))


def test_keep_best_ties_to_latest(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _scripted(monkeypatch, [0.6, 0.8, 0.8])
    pe.finetune(**task, out=str(tmp_path / "run"))
    kept = _model_weights(tmp_path / "run")
    for name, array in seen[2].items():
        np.testing.assert_array_equal(kept[name], array)
    meta = json.loads((tmp_path / "run" / "model" / "pockengine.json").read_text())
    assert meta["weights"]["epoch"] == 3 and meta["weights"]["keep"] == "best"
    assert not np.array_equal(seen[1]["head.weight"], seen[2]["head.weight"])


def test_best_survives_resume(
    tmp_path: Path, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 1 is best; the run stops in epoch 2 and resumes: RUN/model holds epoch 1."""
    seen = _scripted(monkeypatch, [0.9, 0.5])
    options = {**task, "epochs": 2, "out": str(tmp_path / "run")}
    pe.finetune(**options, max_steps=64 // task["batch_size"] + 2)
    assert (tmp_path / "run" / home.BEST).is_file()
    pe.finetune(**options, resume=True)
    kept = _model_weights(tmp_path / "run")
    final = checkpoint.load(tmp_path / "run" / checkpoint.CHECKPOINT).params
    assert len(seen) == 2 and not np.array_equal(final["head.weight"], seen[0]["head.weight"])
    for name, array in seen[0].items():
        np.testing.assert_array_equal(kept[name], array)


# -- the vision recipe (a tiny CNN with batch norm stands in for EfficientNet-Lite0) ----------


class _TinyCNN(torch.nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.fixture
def tiny_vision(monkeypatch: pytest.MonkeyPatch) -> np.ndarray[Any, Any]:
    from pockengine.tasks import vision

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 28, 28), dtype=np.uint8)
    labels = np.arange(40, dtype=np.int64) % 10

    def arrays(config: Any) -> tuple[Any, Any, str]:
        x = vision.preprocess(images, config.image_size)
        return (x[:32], labels[:32]), (x[32:], labels[32:]), "40 random images"

    monkeypatch.setattr(vision, "tasks_arrays", arrays)
    monkeypatch.setattr(vision, "lite0", _TinyCNN)
    return images


def test_vision_model_keeps_its_names_buffers_and_preprocessing(
    tiny_vision: np.ndarray[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pockengine.tasks import vision

    seen = _scripted(monkeypatch, [0.9, 0.5])  # the best (epoch 1) is not the last
    out = tmp_path / "fashion"
    pe.finetune(
        recipe="lite0-fashion",
        scheme="full",
        batchnorm="batch",  # running statistics that training moves (the recipe's: running)
        image_size=8,
        batch_size=8,
        epochs=2,
        progress="none",
        out=str(out),
        compile_in="process",  # the model and images patched in are in this process only
    )
    weights = _model_weights(out)
    assert weights.keys() == _TinyCNN(10).state_dict().keys()
    for name, array in seen[0].items():  # running statistics included
        np.testing.assert_array_equal(weights[name], array, err_msg=name)
    assert not np.array_equal(seen[0]["bn.running_mean"], seen[1]["bn.running_mean"])
    meta = json.loads((out / "model" / "pockengine.json").read_text())
    assert meta["preprocessing"] == vision.preprocessing(8) and meta["classes"] == 10
    loaded = pe.load_run(out)
    probs = loaded.predict_proba(list(tiny_vision[:3]))
    with torch.no_grad():
        want = torch.softmax(
            loaded.model(torch.from_numpy(vision.preprocess(tiny_vision[:3], 8))), -1
        )
    np.testing.assert_allclose(probs, want.numpy(), rtol=1e-6)
    assert loaded.predict([tiny_vision[0]])[0]["label"] in vision.FASHION_LABELS
