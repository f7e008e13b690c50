"""ONNX ops beyond the zoo: ConvTranspose, Resize, InstanceNormalization and
GroupNormalization, the ELU family, backwards Slice, the recurrent layers (LSTM, GRU, RNN,
unrolled) and more reductions. Modules exported by torch.onnx give torch.autograd's
gradients; hand-written nodes with options torch does not export (peepholes, batch-first
layout, other resize modes, SAME_UPPER output shapes) give ONNX Runtime's forward."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

import onnx  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import pockengine as pe  # noqa: E402
from tests.test_aten_coverage import CASES  # noqa: E402
from tests.test_onnx_frontend import _DYNAMO, export  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Recurrent(nn.Module):
    def __init__(self, cell: Any, **kw: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.rnn = cell(6, 5, batch_first=True, **kw)
        self.head = nn.Linear(5 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x: Any) -> Any:
        out, _ = self.rnn(torch.tanh(self.proj(x)))
        return self.head(out.mean(1))


RECURRENT = {
    "gru": (nn.GRU, {}),
    "bidirectional-gru": (nn.GRU, {"bidirectional": True}),
    "lstm": (nn.LSTM, {}),
    "two-layer-bidirectional-lstm": (nn.LSTM, {"bidirectional": True, "num_layers": 2}),
    "relu-rnn-no-bias": (nn.RNN, {"nonlinearity": "relu", "bias": False}),
}
IMAGE = ["bilinear", "bilinear-align-x2", "conv-transpose", "conv-transpose-1d",
         "conv-transpose-groups-dilation", "group-norm", "leaky-relu-elu", "nearest-half",
         "nearest-size", "nearest-x2", "flip-roll-index-select"]  # fmt: skip
TORCHSCRIPT_TOO = {"conv-transpose", "group-norm", "nearest-size", "bilinear"}


def _exported_matches_autograd(model: Any, x: Any, y: Any, path: Path, exporter: str) -> None:
    model.eval()
    ref_model = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref_model(x), y)
    ref_loss.backward()
    ref = {n: p.grad.numpy() for n, p in ref_model.named_parameters()}
    onnx_file = export(model, (x,), path, exporter)
    step = pe.compile(str(onnx_file), loss="cross_entropy", example_batch=(x.numpy(), y.numpy()))
    got = step.gradients(x.numpy(), y.numpy())
    assert set(got) == set(ref)
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=2e-6 * max(scale, 1.0),
                                   err_msg=name)  # fmt: skip
    assert abs(step(x.numpy(), y.numpy()) - float(ref_loss.detach())) < 1e-5


def _image_params() -> list[Any]:
    out = []
    for name in IMAGE:
        for exporter in ("dynamo", "torchscript"):
            if exporter == "dynamo" or name in TORCHSCRIPT_TOO:
                marks = (_DYNAMO,) if exporter == "dynamo" else ()
                out.append(pytest.param(name, exporter, id=f"{name}-{exporter}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "exporter"), _image_params())
def test_exported_image_layers_match_autograd(name: str, exporter: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, _, (x, y) = CASES[name]()
    _exported_matches_autograd(model, x, y, tmp_path / "m.onnx", exporter)


@pytest.mark.parametrize("exporter", [pytest.param("dynamo", marks=_DYNAMO), "torchscript"])
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_exported_recurrent_layers_match_autograd(name: str, exporter: str, tmp_path: Path) -> None:
    cell, kw = RECURRENT[name]
    torch.manual_seed(0)
    model = _Recurrent(cell, **kw)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 7, 4, generator=g), torch.randint(0, 3, (2,), generator=g)
    _exported_matches_autograd(model, x, y, tmp_path / "m.onnx", exporter)


# -- hand-written nodes against ONNX Runtime ---------------------------------------------


def _array(name: str, value: Any, dtype: Any = np.float32) -> Any:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _model(nodes: list[Any], x: Any, inits: list[Any], opset: int = 18) -> Any:
    """``nodes`` reading "x" (the input times a trained scale of 1, so that a model of
    param-free ops has something to train) and writing "Y"."""
    scale = helper.make_node("Mul", ["input", "one"], ["x"])
    graph = helper.make_graph(
        [scale, *nodes], "g",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
        initializer=[*inits, _array("one", np.ones(x.shape[-1]))],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _forward_matches_ort(
    node: Any, x: Any, inits: list[Any], reference: list[Any] | None = None
) -> None:
    """The node's output Y: our MSE against a target equals the MSE of ORT's Y (of the
    ``reference`` nodes where ORT lacks an option)."""
    ort = pytest.importorskip("onnxruntime")
    ref = _model(reference or [node], x, inits).SerializeToString()
    session = ort.InferenceSession(ref, providers=["CPUExecutionProvider"])
    want = session.run(["Y"], {"input": x})[0]
    target = np.random.default_rng(1).standard_normal(want.shape).astype(np.float32)
    step = pe.compile(_model([node], x, inits), loss="mse", example_batch=(x, target),
                      optimizer=pe.optim.SGD(lr=0.0))  # fmt: skip
    expected = float(np.mean((want.astype(np.float64) - target) ** 2))
    assert step(x, target) == pytest.approx(expected, rel=1e-5)


def test_lstm_with_peepholes_batch_first_and_initial_states() -> None:
    rng = np.random.default_rng(0)
    h, d = 5, 2
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)  # layout 1: [batch, seq, in]
    inits = [
        _array("W", rng.standard_normal((d, 4 * h, 4)) * 0.5),
        _array("R", rng.standard_normal((d, 4 * h, h)) * 0.5),
        _array("B", rng.standard_normal((d, 8 * h))),
        _array("h0", rng.standard_normal((2, d, h))),
        _array("c0", rng.standard_normal((2, d, h))),
        _array("P", rng.standard_normal((d, 3 * h))),
    ]
    node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0", "P"], ["Y"],
                            hidden_size=h, direction="bidirectional", layout=1)  # fmt: skip
    # ONNX Runtime has no batch-first LSTM: the same layer time-major, between transposes
    reference = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["h0"], ["h0t"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["c0"], ["c0t"], perm=[1, 0, 2]),
        helper.make_node("LSTM", ["xt", "W", "R", "B", "", "h0t", "c0t", "P"], ["Yt"],
                         hidden_size=h, direction="bidirectional"),
        helper.make_node("Transpose", ["Yt"], ["Y"], perm=[2, 0, 1, 3]),
    ]  # fmt: skip
    _forward_matches_ort(node, x, inits, reference)


@pytest.mark.parametrize("before_reset", [0, 1])
def test_reverse_gru(before_reset: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 3)).astype(np.float32)
    inits = [
        _array("W", rng.standard_normal((1, 12, 3))),
        _array("R", rng.standard_normal((1, 12, 4))),
        _array("B", rng.standard_normal((1, 24))),
    ]
    node = helper.make_node("GRU", ["x", "W", "R", "B"], ["Y"], hidden_size=4,
                            direction="reverse", linear_before_reset=before_reset)  # fmt: skip
    _forward_matches_ort(node, x, inits)


@pytest.mark.parametrize(
    ("mode", "coords", "nearest", "size"),
    [
        ("nearest", "half_pixel", "round_prefer_floor", [1, 2, 7, 13]),
        ("nearest", "asymmetric", "ceil", [1, 2, 9, 4]),
        ("nearest", "align_corners", "round_prefer_ceil", [1, 2, 11, 3]),
        ("linear", "asymmetric", "floor", [1, 2, 12, 10]),
        ("linear", "pytorch_half_pixel", "floor", [1, 2, 3, 7]),
    ],
)
def test_resize_modes(mode: str, coords: str, nearest: str, size: list[int]) -> None:
    x = np.random.default_rng(0).standard_normal((1, 2, 6, 5)).astype(np.float32)
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["Y"], mode=mode,
                            coordinate_transformation_mode=coords,
                            nearest_mode=nearest)  # fmt: skip
    _forward_matches_ort(node, x, [_array("sizes", size, np.int64)])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "NOTSET"])
def test_conv_transpose_output_shapes(auto_pad: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    attrs: dict[str, Any] = {"strides": [2, 3], "auto_pad": auto_pad}
    if auto_pad == "NOTSET":
        attrs["output_shape"] = [10, 11]
    node = helper.make_node("ConvTranspose", ["x", "W", "b"], ["Y"], **attrs)
    _forward_matches_ort(node, x, [_array("W", rng.standard_normal((2, 3, 3, 4))),
                                   _array("b", rng.standard_normal(3))])  # fmt: skip


@pytest.mark.parametrize(
    ("op", "attrs"),
    [("ReduceMin", {"keepdims": 0}), ("ReduceL1", {}), ("ReduceL2", {"keepdims": 0}),
     ("ReduceSumSquare", {}), ("Celu", {"alpha": 0.7}), ("Selu", {}), ("Softplus", {}),
     ("Softsign", {}),
     ("InstanceNormalization", {"epsilon": 1e-3})],
)  # fmt: skip
def test_reductions_and_activations(op: str, attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    inputs, inits = ["x"], []
    if op.startswith("Reduce"):
        inputs, inits = ["x", "axes"], [_array("axes", [1], np.int64)]
    if op == "InstanceNormalization":
        inputs = ["x", "s", "b"]
        inits = [_array("s", rng.standard_normal(3)), _array("b", rng.standard_normal(3))]
    _forward_matches_ort(helper.make_node(op, inputs, ["Y"], **attrs), x, inits)


def test_argmax_first_and_last_of_equal_maxima() -> None:
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    for last, want in ((0, [1.0, 0.0]), (1, [2.0, 3.0])):
        nodes = [
            helper.make_node("ArgMax", ["x"], ["i"], axis=1, keepdims=0, select_last_index=last),
            helper.make_node("Cast", ["i"], ["Y"], to=onnx.TensorProto.FLOAT),
        ]
        target = np.zeros(2, np.float32)
        step = pe.compile(_model(nodes, x, []), loss="mse", example_batch=(x, target))
        assert step(x, target) == pytest.approx(np.mean(np.square(want)))


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
        ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
        ("ij,jk", [(2, 3, 4)[1:], (4, 5)]),
        ("ijk,ik->j", [(2, 3, 4), (2, 4)]),
        ("ijk->kj", [(2, 3, 4)]),
    ],
)
def test_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shapes[0]).astype(np.float32)
    inputs = ["x", *(f"w{i}" for i in range(1, len(shapes)))]
    inits = [_array(f"w{i}", rng.standard_normal(s)) for i, s in enumerate(shapes[1:], 1)]
    _forward_matches_ort(helper.make_node("Einsum", inputs, ["Y"], equation=equation), x, inits)


def test_conv_transpose_output_shape_beyond_its_input_is_named() -> None:
    """ONNX Runtime refuses it too; the error names the shapes, not a slice inside."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "W"], ["Y"], strides=[2, 2],
                            output_shape=[14, 12])  # fmt: skip
    model = _model([node], x, [_array("W", rng.standard_normal((2, 3, 3, 3)))])
    target = np.zeros((1, 3, 14, 12), np.float32)
    with pytest.raises(pe.CompileError, match=r"output shape \[14, 12\] is larger than its"):
        pe.compile(model, loss="mse", example_batch=(x, target))


def test_exported_top_k_router_matches_autograd(tmp_path: Path) -> None:
    """ONNX ``TopK`` (a mixture-of-experts router) becomes the IR's ``topk``."""
    from pockengine.zoo_blocks import MoE

    torch.manual_seed(0)
    model = nn.Sequential(MoE(8, experts=4, k=2), nn.Linear(8, 3))
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    _exported_matches_autograd(model, x, y, tmp_path / "m.onnx", "torchscript")
