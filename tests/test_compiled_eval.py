"""Evaluation through the compiled forward (``pockengine.step.evaluator``, ``metrics.evaluate``)
against the eager torch path, and the model's float copies of quantized weights released
(what then reads the step instead: the best weights, ``RUN/model``)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pockengine as pe
from pockengine.finetune.run_folder import home, released
from pockengine.ir import CompileError, Role
from pockengine.optim import AdamW
from pockengine.step.evaluator import compile_evaluator as compile_raw
from pockengine.tasks.causal_lm import causal_lm_loss
from pockengine.tasks.config import FinetuneConfig
from pockengine.tasks.metrics import CLASSIFY_BATCH, compile_evaluator, evaluate
from pockengine.tasks.recipes import Task, classify_loss

VOCAB = 8192  # the smallest vocabulary the fused loss takes


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(24, 5))  # fmt: skip


def _classify_task(model: nn.Module, n_val: int) -> Task:
    rng = np.random.default_rng(0)
    split = (rng.standard_normal((n_val, 12)).astype(np.float32), rng.integers(0, 5, n_val))
    train = (rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 5, 16))
    return Task("toy", model, classify_loss, train, split, tuple("abcde"))


def _trained_step(task: Task, steps: int = 3) -> pe.TrainStep:
    example = tuple(torch.from_numpy(a[:8]) for a in task.train)
    task.model.train()
    step = pe.compile(task.model, task.loss_fn, example, AdamW(lr=0.05), backend="numpy")
    for k in range(steps):
        step(*(a[8 * (k % 2) : 8 * (k % 2) + 8] for a in task.train))
    return step


def test_classification_equals_eager_with_a_short_last_batch() -> None:
    task = _classify_task(_classifier(), CLASSIFY_BATCH + 7)  # one full batch, one padded
    step = _trained_step(task)
    evaluator = compile_evaluator(step, task)
    assert evaluator is not None and evaluator.batch_size == CLASSIFY_BATCH
    assert "dropout" not in str(evaluator.graph)  # eval mode
    compiled = evaluate(step, task, evaluator=evaluator)
    eager = evaluate(step, task)
    assert compiled["val_accuracy"] == eager["val_accuracy"]
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)


def test_the_evaluator_reads_the_steps_current_values() -> None:
    task = _classify_task(_classifier(), 20)
    step = _trained_step(task, steps=1)
    evaluator = compile_evaluator(step, task)
    before = evaluate(step, task, evaluator=evaluator)
    for _ in range(4):
        step(*(a[:8] for a in task.train))
    after = evaluate(step, task, evaluator=evaluator)
    assert after["val_loss"] != before["val_loss"]
    assert after["val_loss"] == pytest.approx(evaluate(step, task)["val_loss"], rel=1e-5)


def test_ties_count_as_torch_argmax_does() -> None:
    """Equal logits: the first one is the prediction (label 0 right, label 1 wrong)."""
    model = nn.Linear(3, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([2.0, 2.0, 1.0, 2.0]))
    x = np.ones((6, 3), np.float32)
    task = Task("ties", model, classify_loss, (x, np.zeros(6, np.int64)),
                (x, np.array([0, 1, 3, 0, 2, 1])), tuple("abcd"))  # fmt: skip
    step = pe.compile(model, classify_loss, (torch.from_numpy(x), torch.zeros(6).long()))
    evaluator = compile_evaluator(step, task)
    compiled = evaluate(step, task, evaluator=evaluator)
    assert compiled["val_accuracy"] == evaluate(step, task)["val_accuracy"] == 2 / 6


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config).float()


def _lm_task(model: nn.Module, n_val: int = 5) -> Task:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (4 + n_val, 16))
    return Task("lm", model, causal_lm_loss, (ids[:4],), (ids[4:],), (), kind="causal-lm",
                home={"format": "hf-causal-lm"})  # fmt: skip


def _lm_step(task: Task) -> pe.TrainStep:
    task.model.train()
    scheme = pe.schemes.bias_only()
    step = pe.compile(task.model, task.loss_fn, (torch.from_numpy(task.train[0]),),
                      AdamW(lr=0.01), scheme, backend="torch", frozen_dtype="int8")  # fmt: skip
    step(task.train[0])
    return step


@pytest.fixture(scope="module")
def lm() -> tuple[Task, pe.TrainStep, nn.Module]:
    """A trained int8 step, its task and a float reference model with the step's values."""
    task = _lm_task(_tiny_llama())
    step = _lm_step(task)
    reference = copy.deepcopy(task.model)
    step.load_into(reference)
    return task, step, reference


def test_causal_lm_runs_the_fused_loss_on_quantized_weights(
    lm: tuple[Task, pe.TrainStep, nn.Module],
) -> None:
    task, step, reference = lm
    evaluator = compile_evaluator(step, task)
    assert evaluator is not None and evaluator.batch_size == 5
    graph = evaluator.graph
    ops = {n.op for n in graph.nodes}
    assert "linear_log_softmax_gather" in ops and "dequantize" in ops
    # the only vocabulary-wide value is the dequantized (tied) head, [vocab, hidden]: no logits
    wide = {v.shape for n in graph.nodes for v in n.outputs if VOCAB in v.shape}
    assert wide == {(VOCAB, 32)}
    assert {v.name for v in graph.inputs if v.role is not Role.INPUT} <= set(step._store)
    compiled = evaluate(step, task, evaluator=evaluator)
    eager = evaluate(step, _with_model(task, reference))
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)


def _with_model(task: Task, model: nn.Module) -> Task:
    return dataclasses.replace(task, model=model)


def test_released_model_still_evaluates_and_its_saved_folder_predicts_the_same(
    lm: tuple[Task, pe.TrainStep, nn.Module], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    task, step, reference = lm
    task = _with_model(task, copy.deepcopy(task.model))
    task.tokenizer = _NoTokenizer()
    evaluator = compile_evaluator(step, task)
    before = evaluate(step, task, evaluator=evaluator)
    freed = released.release_held(task.model, step)
    assert freed >= VOCAB * 32 * 4 and released.is_released(task.model)
    assert task.model.lm_head.weight is task.model.model.embed_tokens.weight  # still tied
    assert evaluate(step, task, evaluator=evaluator) == before
    best = home.BestWeights(tmp_path / home.BEST, task.kind)
    config = FinetuneConfig(keep="last", seq_len=16)
    folder = home.write_model(tmp_path, task, released.step_values(step), config, best, [], 1)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.from_numpy(task.val[0])
    with torch.no_grad():
        want = reference.eval()(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want)


class _NoTokenizer:
    def save_pretrained(self, folder: str) -> None:
        (Path(folder) / "tokenizer.json").write_text("{}")


def test_best_weights_are_read_from_the_step(tmp_path: Path) -> None:
    task = _classify_task(_classifier(), 10)
    step = _trained_step(task)
    best = home.BestWeights(tmp_path / home.BEST, task.kind)
    names = home.changed_names((n for n, _ in task.model.named_buffers()), step.trained)
    assert best.offer({"step": 3, "val_accuracy": 0.5}, released.step_values(step), names)
    kept = best.tensors()
    state = step.flat_state_dict()
    assert set(kept) == {n for n in names if n in state}
    for name, value in kept.items():
        np.testing.assert_array_equal(value, state[name])


def test_eval_output_rules_and_other_frontends(caplog: pytest.LogCaptureFixture) -> None:
    task = _classify_task(_classifier(), 8)
    step = _trained_step(task, steps=0)
    batch = (torch.zeros(8, 12), torch.zeros(8, dtype=torch.long))
    evaluator = compile_evaluator(step, task)
    assert evaluator is not None
    with pytest.raises(pe.BatchError, match=r"batch entry 0: compiled for f32\[8,12\]"):
        evaluator(np.zeros((3, 12), np.float32), np.zeros(3, np.int64), np.ones(3, np.float32))
    with pytest.raises(CompileError, match="float scalar or vector"):
        step.evaluator(task.model, lambda m, x, y: m(x), batch)
    with pytest.raises(CompileError, match="loss_fn must return a float scalar"):
        pe.compile(task.model, lambda m, x, y: torch.stack([m(x).sum(), m(x).mean()]), batch)
    with pytest.raises(CompileError, match="not supported for the jax frontend"):
        compile_raw(step, step.forward, {"w": np.zeros(3)}, lambda p, x: x, batch)
    jax_task = _classify_task(_Params(), 8)
    with caplog.at_level(logging.WARNING):
        assert compile_evaluator(step, jax_task) is None
    assert "eagerly" in caplog.text


class _Params(dict[str, Any]):
    """Not a torch module: the frontend would be JAX's."""
