"""``pockengine evaluate``: a run's model (``RUN/model``) on its validation split or a file.

The validation split is rebuilt by the run's own recipe from the options it stored (the
same split, tokenisation and order as during training), and the loop is the one
validation runs (``metrics.evaluate``: batches of 64, summed cross-entropy), so on the
same weights the accuracy equals the one in ``summary.json``. A classifier gets accuracy,
macro-F1 (over the classes present in the labels or the predictions), per-class precision,
recall and F1, and a confusion matrix (rows: true, columns: predicted; also drawn to
``RUN/confusion.png``); a causal LM gets its mean token loss and perplexity.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pockengine.finetune.run_folder.home import META, MODEL_DIR
from pockengine.finetune.run_folder.home_load import LoadedRun
from pockengine.finetune.run_folder.run_meta import RunFileError
from pockengine.finetune.trained import lm_eval
from pockengine.ir.arrays import Array
from pockengine.safe_write import check_no_links, write_json, write_with
from pockengine.tasks import data as ds
from pockengine.tasks import recipes
from pockengine.tasks.config import FinetuneConfig, FinetuneError

__all__ = ["CONFUSION_PNG", "EVAL_JSON", "evaluate_run", "format_eval", "plot_confusion"]
EVAL_JSON = "eval.json"
CONFUSION_PNG = "confusion.png"
_TEXT_SUFFIXES = (".txt", ".md", ".rst")


def evaluate_run(loaded: LoadedRun, data: str | None = None) -> dict[str, Any]:
    """Metrics of the loaded model on ``data`` (default: the run's validation split)."""
    where = data or "the run's validation split"
    if lm_eval.is_packed_run(loaded.meta):
        arrays = (
            lm_eval.file_arrays(loaded.tokenizer, loaded.meta, Path(data))
            if data
            else _validation(loaded)
        )
        result = lm_eval.packed_perplexity(loaded.model, arrays)
        return {"data": where, "weights": loaded.meta.get("weights", {}), **result}
    arrays = _file_arrays(loaded, Path(data)) if data else _validation(loaded)
    with torch.no_grad():
        if loaded.is_causal_lm:
            result = _perplexity(loaded, arrays[0])
        else:
            result = _classification(loaded, arrays)
    return {"data": where, "weights": loaded.meta.get("weights", {}), **result}


def _validation(loaded: LoadedRun) -> tuple[Array, ...]:
    """The validation arrays of the run, rebuilt by its recipe."""
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    options = {k: v for k, v in (loaded.meta.get("config") or {}).items() if k in fields}
    try:  # the options are data; a factory among them is the one the user named (load_run)
        config = FinetuneConfig(**options).validate()
    except (FinetuneError, TypeError, ValueError) as exc:
        where = loaded.path / MODEL_DIR / META
        raise RunFileError(f"{where}: 'config' does not hold a run's options: {exc}") from exc
    return recipes.build(config).val


def _file_arrays(loaded: LoadedRun, path: Path) -> tuple[Array, ...]:
    if loaded.is_causal_lm:
        from pockengine.tasks import causal_lm

        texts = _texts(path)
        chunks = causal_lm.pack(loaded.tokenizer, texts, int(loaded.meta["seq_len"]), None)
        if not len(chunks):
            raise FinetuneError(f"{path}: fewer than {loaded.meta['seq_len']} tokens of text")
        return (chunks,)
    if loaded.kind == "vision":
        raise FinetuneError(
            "evaluate --data takes text datasets; a vision run evaluates "
            "on its own validation split (leave out --data)"
        )
    config = loaded.meta.get("config", {})
    dataset = ds.load_dataset(
        path,
        config.get("text_column", "text"),
        config.get("label_column", "label"),
        config.get("encoding", "utf-8"),
    )
    unknown = sorted(set(dataset.labels) - set(loaded.labels))
    if unknown:
        raise FinetuneError(
            f"{path} has labels the model does not know: {unknown}; its labels are "
            f"{list(loaded.labels)}"
        )
    return (*loaded.encode(dataset.texts), dataset.label_ids(loaded.labels))


def _texts(path: Path) -> list[str]:
    """A text file, or the text files (``.txt``, ``.md``, ``.rst``) under a folder."""
    files = (
        sorted(
            p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES or p.name.endswith(".rst.txt")
        )
        if path.is_dir()
        else [path]
    )
    if not files or not files[0].is_file():
        raise FinetuneError(f"{path}: no text file to evaluate on")
    return [f.read_bytes().decode("utf-8", errors="replace") for f in files]


def _classification(
    loaded: LoadedRun, arrays: tuple[Array, ...], batch: int = 64
) -> dict[str, Any]:
    *inputs, labels = arrays
    n = len(labels)
    total_loss, predicted = 0.0, []
    for start in range(0, n, batch):  # as metrics.evaluate does, to the last bit
        logits = loaded.model(*recipes.tensor_rows(inputs, start, start + batch))
        target = torch.from_numpy(labels[start : start + batch])
        total_loss += float(F.cross_entropy(logits, target, reduction="sum"))
        predicted.append(logits.argmax(-1).numpy())
    pred = np.concatenate(predicted) if predicted else np.zeros(0, np.int64)
    k = len(loaded.labels)
    confusion = np.bincount(labels * k + pred, minlength=k * k).reshape(k, k)
    return {
        "examples": n,
        "accuracy": int((pred == labels).sum()) / n,
        **_per_class(confusion, loaded.labels),
        "loss": total_loss / n,
        "labels": list(loaded.labels),
        "confusion": confusion.tolist(),
    }


def _per_class(confusion: Array, labels: tuple[str, ...]) -> dict[str, Any]:
    """Precision, recall, F1 and support of each class; macro-F1 over the classes present."""
    per_class, f1s = {}, []
    for i, name in enumerate(labels):
        tp, support, predicted = confusion[i, i], confusion[i].sum(), confusion[:, i].sum()
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[name] = {
            "precision": float(precision),
            "recall": float(recall),
            "f1": float(f1),
            "support": int(support),
        }
        if support or predicted:
            f1s.append(f1)
    return {"macro_f1": float(np.mean(f1s)) if f1s else 0.0, "per_class": per_class}


def _perplexity(loaded: LoadedRun, chunks: Array, batch: int = 8) -> dict[str, Any]:
    """As ``metrics.evaluate`` does for a causal LM: every next token of a chunk."""
    total_loss, tokens = 0.0, 0
    for start in range(0, len(chunks), batch):
        ids = torch.from_numpy(chunks[start : start + batch])
        logits = loaded.model(input_ids=ids, use_cache=False).logits[:, :-1]
        targets = ids[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum")
        total_loss += float(loss)
        tokens += int(targets.numel())
    mean = total_loss / max(tokens, 1)
    return {
        "chunks": len(chunks),
        "tokens": tokens,
        "loss": mean,
        "perplexity": math.exp(min(mean, 700.0)),
    }


def write_eval(run: Path, result: dict[str, Any]) -> tuple[list[Path], list[str]]:
    """``RUN/eval.json`` and, for a classifier, ``RUN/confusion.png``: the paths written
    and a note for each file left out (the picture, without matplotlib)."""
    written, notes = [run / EVAL_JSON], []
    targets = written + ([run / CONFUSION_PNG] if "confusion" in result else [])
    for target in targets:  # a link at either target refuses both, before anything is written
        check_no_links(target, run)
    write_json(written[0], result)
    if "confusion" in result:
        try:
            written.append(plot_confusion(result, run / CONFUSION_PNG))
        except ImportError:
            missing = "matplotlib is not installed (pip install matplotlib)"
            notes.append(f"{run / CONFUSION_PNG} not drawn: {missing}; eval.json has the matrix")
    return written, notes


def plot_confusion(result: dict[str, Any], path: Path) -> Path:
    """The confusion matrix as a picture, counts in the cells (``ImportError`` without
    matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, matrix = result["labels"], np.asarray(result["confusion"])
    side = max(4.0, 0.6 * len(labels) + 2)
    fig, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f}")
    for (i, j), count in np.ndenumerate(matrix):
        dark = count > matrix.max() / 2
        ax.text(j, i, str(count), ha="center", va="center", color="white" if dark else "black")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    try:
        write_with(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path


def format_eval(result: dict[str, Any]) -> str:
    """The metrics as a person reads them: a line, the per-class table, the matrix."""
    if "perplexity" in result:
        return (
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
            f"({result['tokens']} tokens in {result['chunks']} chunks; {result['data']})"
        )
    labels = result["labels"]
    width = max(12, *(len(name) for name in labels))
    lines = [
        f"accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f}, loss "
        f"{result['loss']:.4f} ({result['examples']} examples; {result['data']})",
        "",
        f"{'class':<{width}}  precision  recall      f1  support",
    ]
    for name, row in result["per_class"].items():
        lines.append(
            f"{name:<{width}}  {row['precision']:9.4f}  {row['recall']:6.4f}  "
            f"{row['f1']:6.4f}  {row['support']:7d}"
        )
    cell = max(5, *(len(str(c)) for r in result["confusion"] for c in r))
    lines += ["", "confusion (rows: true, columns: predicted, in the order above):"]
    lines += [
        f"{name:<{width}}  " + " ".join(f"{c:>{cell}}" for c in row)
        for name, row in zip(labels, result["confusion"], strict=True)
    ]
    return "\n".join(lines)
