"""The memory of a fine-tune's phases (benchmarks/run_memory.py) and the chunked encoding
that keeps the data path's memory small."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import mmap
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import torch

from pockengine import zoo
from pockengine.backends.torch import kernels_rng as torch_kernels_rng
from pockengine.ir import get_op
from pockengine.tasks import data as ds
from pockengine.tasks import models, recipes
from pockengine.tasks.config import FinetuneConfig

_MIB = 1 << 20
_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_memory.py"


def _run_memory() -> ModuleType:
    if str(_SCRIPT.parent) not in sys.path:  # as when it runs: its folder's _harness
        sys.path.append(str(_SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("run_memory", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_memory"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_phase_peak_is_what_ran_inside_it_alone() -> None:
    rm = _run_memory()
    log = rm.PhaseLog()
    size = 64 * _MIB

    def allocate() -> int:
        # fresh pages, touched: an anonymous mapping is new memory whatever the heap of this
        # (long-lived test worker) process holds free, and it is gone at close
        block = mmap.mmap(-1, size)
        try:
            for at in range(0, size, mmap.PAGESIZE):
                block[at] = 1
            return block[size - 1 - (size - 1) % mmap.PAGESIZE]
        finally:
            block.close()

    owner = SimpleNamespace(allocate=allocate)
    log.around(owner, "allocate", "allocate", limit=1)
    assert owner.allocate() == 1
    owner.allocate()  # past the limit: no rows of its own
    log.mark("after")
    names = [p.name for p in log.phases]
    assert names == ["before allocate 1", "allocate 1", "after"]
    before, inside, after = log.phases
    assert inside.peak - before.rss >= size * 0.9
    assert after.peak - inside.rss >= size * 0.9  # the uncounted second call
    assert inside.rss < before.rss + size / 2  # freed at its end


def test_chunked_encoding_gives_the_ids_of_one_call() -> None:
    tokenizer = models.load_hf_tokenizer(str(zoo.minilm_path()))
    texts = [f"text {i}: " + "word " * (3 * i) for i in range(11)]  # some longer than 16
    ids, mask = ds.encode_hf(tokenizer, texts, 16, chunk=4)
    whole = tokenizer(texts, padding="max_length", truncation=True, max_length=16,
                      return_tensors="np")  # fmt: skip
    np.testing.assert_array_equal(ids, whole["input_ids"])
    np.testing.assert_array_equal(mask, whole["attention_mask"])
    assert ids.dtype == mask.dtype == np.int64 and ids.shape == (11, 16)
    assert mask[:, -1].any() and not mask[0, -1]  # truncated and padded rows both present


def test_a_mask_larger_than_a_chunk_is_the_reference_mask() -> None:
    """The torch kernel hashes a mask in chunks of scratch; across chunk edges, and in the
    last partial chunk, it gives the NumPy reference's mask bit for bit."""
    shape, p, salt = (3, torch_kernels_rng.MASK_CHUNK // 2 + 7), 0.1, 2**33 + 5
    seed = np.asarray(-12345, dtype=np.int64)
    n = math.prod(shape)
    got = torch_kernels_rng.random_mask(
        torch.from_numpy(seed), torch_kernels_rng.mix_int(salt & 0xFFFFFFFF),
        math.ceil(p * 2.0**32), float(np.float32(1 / (1 - p))), shape,
    )  # fmt: skip
    want = get_op("random_mask").kernel(seed, shape=shape, p=p, salt=salt)
    assert n > torch_kernels_rng.MASK_CHUNK and n % torch_kernels_rng.MASK_CHUNK
    np.testing.assert_array_equal(got.numpy(), want)


def test_the_recipe_recomputation_budget_is_not_part_of_what_trains() -> None:
    """minilm-bbc's sparse step recomputes under a budget by default; a budget changes no
    result, so a run resumes under another (it is not in the checkpoint's training options)."""
    config = FinetuneConfig(recipe="minilm-bbc")
    budget = recipes.defaults(config)["remat_budget"]
    assert budget > 0
    filled = config.with_defaults(recipes.defaults(config)).validate()
    assert filled.remat_budget == budget
    assert "remat_budget" not in filled.training_dict()
    other = dataclasses.replace(filled, remat_budget=2 * budget)
    assert other.training_dict() == filled.training_dict()
    # chosen for the recipe's sparse step at its own batch shape, not for another
    for changed in ({"batch_size": 64}, {"seq_len": 256}, {"scheme": "full"}):
        assert "remat_budget" not in recipes.defaults(
            FinetuneConfig(recipe="minilm-bbc", **changed)
        )
    assert recipes.defaults(FinetuneConfig(recipe="minilm-bbc", batch_size=16))["remat_budget"]
    # --remat-budget none turns the recipe's budget off: 0 survives the defaults, and the
    # trainer compiles without one
    from pockengine.finetune.cli import budget_or_none
    from pockengine.finetune.compiling import task_step

    assert budget_or_none("none") == 0.0 and budget_or_none("1MB") == 1 << 20
    off = FinetuneConfig(recipe="minilm-bbc", remat_budget=0.0)
    assert off.with_defaults(recipes.defaults(off)).validate().remat_budget == 0.0
    assert task_step.remat_budget(off) is None
    assert task_step.remat_budget(dataclasses.replace(off, remat_budget=1.5e6)) == 1_500_000


def test_a_recipe_budget_applies_only_to_the_settings_it_was_measured_at() -> None:
    """smollm2-pydocs' budgets were measured with GGUF frozen weights (700 MiB) and with
    8-bit AdamW state too (450 MiB): its float32 weights alone (540 MiB) could meet
    neither, so a run with them recomputes nothing by default (it used to warn that the
    budget was not met on every default run)."""

    def budget(**settings: str) -> object:
        return recipes.defaults(FinetuneConfig(recipe="smollm2-pydocs", **settings)).get(
            "remat_budget"
        )

    assert budget() is None
    assert budget(frozen_dtype="gguf") == 700 << 20
    assert budget(frozen_dtype="gguf", optimizer_state="int8") == 450 << 20
    assert budget(frozen_dtype="int8") is None
