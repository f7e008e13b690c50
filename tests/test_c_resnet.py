"""ResNet-18 (``zoo.resnet18``: a 7x7 stem at stride 2, padded max pooling, basic blocks
with strided 3x3 and 1x1 shortcut convolutions into each stage) on 64 x 64 images, batch 2
(its last stage on 2 x 2 maps; at 32 x 32 batch norm over a batch of 1 x 1 maps normalises
two values a channel, too ill-conditioned to compare): trained 3 steps by the C backend as
by the NumPy backend, full and with the sparse recipe (float32, SGD with momentum), the
strided input gradients by col2im and the padded pooling by its row loops; its gradients
match torch.autograd's on the same weights.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


@pytest.mark.parametrize("scheme_name", ["sparse", "full"])
def test_resnet18_trains_as_numpy(scheme_name: str) -> None:
    scheme = zoo.benchmark_schemes("resnet18")[scheme_name]

    def run(backend: str) -> tuple[list[float], Any]:
        w = zoo.resnet18(batch=2, size=64)
        opt = pe.optim.SGD(lr=1e-3, momentum=0.9)
        step = pe.compile(w.model, w.loss_fn, w.make_batch(0), opt, scheme, backend=backend)
        return [step(*w.make_batch(i)) for i in range(3)], step

    want, numpy_step = run("numpy")
    got, c_step = run("c")
    source = c_step._exec.source
    assert "pe_conv2d_input_grad_im2col_f32(" in source  # strided: col2im
    assert "pe_max_pool2d_f32(" in source
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for name, value in numpy_step.state_dict().items():
        np.testing.assert_allclose(c_step.state_dict()[name], value, rtol=2e-3, atol=1e-4,
                                   err_msg=name)  # fmt: skip


def test_resnet18_gradients_match_torch_autograd() -> None:
    """Every parameter's gradient of the C step on one batch against torch.autograd on the
    same model and weights (train mode: batch statistics)."""
    w = zoo.resnet18(batch=2, size=64)
    batch = w.make_batch(0)
    step = pe.compile(w.model, w.loss_fn, batch, pe.optim.SGD(lr=1e-3), backend="c")
    got = step.gradients(*batch)
    w.model.zero_grad()
    w.loss_fn(w.model, *batch).backward()
    for name, p in w.model.named_parameters():
        want = p.grad.detach().numpy()
        scale = max(float(np.abs(want).max()), 1e-3)
        np.testing.assert_allclose(got[name], want, rtol=0, atol=2e-4 * scale, err_msg=name)
